"""Everything a run reads from the user, resolved before anything starts.

`resolve_inputs(cfg, workdir)` runs in `rljax.main.start` after the config checks and before preflight,
the vLLM server, the reward workers or any allocation: the workdir is created and written to; the model
directory's config.json, every safetensors header (a truncated file fails here, not mid-load) and the
tokenizer are read; the data source is loaded and split, and the prompt template filled from its
examples; every reward spec (`reward.functions`, `reward.eval_function`) and the environment are looked
up. Each problem is a `ConfigError` naming the field or file and what would be valid, which the runtime
prints as one line before exiting 2.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any

from rljax.config import Config, ConfigError, DataConfig
from rljax.data import format_prompt
from rljax.data.chat import is_conversation
from rljax.loop.data_setup import load_examples
from rljax.metrics import parameters
from rljax.metrics.logger import METRICS_FILE, TENSORBOARD_DIR
from rljax.metrics.status import STATUS_DIR

# Errors a data source raises for bad user input (a missing file, a bad record, a wrong option, a
# record nested deeper than the JSON parser's recursion limit).
_DATA_ERRORS = (OSError, ValueError, KeyError, TypeError, ImportError, RecursionError)


def _text(e: BaseException) -> str:
    """An exception's message; a KeyError's key without the quotes `str()` adds."""
    return e.args[0] if isinstance(e, KeyError) and e.args else str(e)


def resolve_inputs(cfg: Config, workdir: str) -> tuple[list[dict], list[dict]]:
    """Checks every user input of the run (see the module doc); returns the (train, eval) examples."""
    check_workdir(workdir)
    check_env(cfg)
    check_rewards(cfg)
    train, held_out = resolve_examples(cfg.data)
    tokenizer = check_model_dir(cfg.model.path)  # last: loading the tokenizer imports transformers
    check_prompt_lengths(cfg, tokenizer, train + held_out)
    return train, held_out


# What a run keeps in its workdir, by kind: an entry of another kind (a file named `checkpoints`, a
# directory named `metrics.jsonl`, a FIFO) fails here instead of deep inside orbax or a writer.
RUN_DIR_ENTRIES = {
    **dict.fromkeys(
        ("checkpoints", TENSORBOARD_DIR, STATUS_DIR, "vllm", "logs", "profile", "eval"), "directory"
    ),
    **dict.fromkeys((METRICS_FILE, parameters.FILENAME, "wandb_run_id"), "file"),
}


def check_workdir(workdir: str) -> None:
    """Creates `workdir` and writes a file in it, and every entry a run keeps there (RUN_DIR_ENTRIES)
    that exists is of its kind; ConfigError naming --workdir otherwise."""
    try:
        os.makedirs(workdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as e:
        raise ConfigError(
            "--workdir",
            f"{workdir!r} is not a writable directory ({e.strerror or e}); pass one you can write",
        ) from None
    for name, kind in RUN_DIR_ENTRIES.items():
        path = os.path.join(workdir, name)
        if not os.path.lexists(path):
            continue
        found = "a directory" if os.path.isdir(path) else "a file" if os.path.isfile(path) else "not a file"
        if found != f"a {kind}":
            raise ConfigError(
                "--workdir",
                f"{path} is {found}; a run keeps a {kind} there: move it away or pass another workdir",
            )


def check_model_dir(path: str) -> Any:
    """config.json parses, every safetensors header is intact and matches it, the tokenizer loads and
    fits the model's vocabulary. Returns the tokenizer."""
    from rljax.models.hf import CheckpointFormatError, check_hf_checkpoint, load_tokenizer

    try:
        model_config = check_hf_checkpoint(path)
    except (CheckpointFormatError, OSError, ValueError) as e:
        raise ConfigError("model.path", f"{e} (a local Hugging Face checkpoint directory)") from None
    try:
        tokenizer = load_tokenizer(path)
        size = len(tokenizer)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for missing/broken files
        raise ConfigError(
            "model.path", f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})"
        ) from None
    # Without its files transformers builds an empty tokenizer (1 token) instead of failing.
    if not 1 < size <= model_config.vocab_size:
        raise ConfigError(
            "model.path",
            f"{path}: the tokenizer has {size} tokens, the model's vocabulary {model_config.vocab_size} "
            "(tokenizer files missing or from another model: tokenizer.json, tokenizer_config.json)",
        )
    return tokenizer


def check_prompt_lengths(cfg: Config, tokenizer: Any, examples: list[dict]) -> None:
    """Every prompt, rendered as the sampler renders it, leaves `rollout.max_tokens` completion tokens
    within `rollout.vllm.max_model_len` (the engine refuses a longer request at the first step)."""
    from rljax.data import make_prompt_renderer

    data, limit = cfg.data, cfg.rollout.vllm.max_model_len - cfg.rollout.max_tokens
    renderer = make_prompt_renderer(
        tokenizer, template=data.template, chat_template=data.chat_template, system_prompt=data.system_prompt
    )
    try:
        texts = [renderer.text(example) for example in examples]
    except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
        what = f"an example does not fill it: {type(e).__name__}: {_text(e)}"
        raise ConfigError("data.template", what) from None
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
    if longest is not None and lengths[longest] > limit:
        over = sum(n > limit for n in lengths)
        raise ConfigError(
            "rollout.vllm.max_model_len",
            f"{cfg.rollout.vllm.max_model_len} is too short: {over} of {len(lengths)} examples have a prompt "
            f"of more than {limit} tokens (the longest {lengths[longest]}, example "
            f"{examples[longest].get('prompt')!r:.60}), which leaves no room for rollout.max_tokens="
            f"{cfg.rollout.max_tokens}; raise it, or drop or shorten those prompts",
        )


def resolve_examples(data: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval) examples of `data`, with the prompt template filled from one of each; ConfigError
    naming the data.* field otherwise."""
    try:
        train, held_out = load_examples(data)
    except ConfigError:
        raise
    except _DATA_ERRORS as e:
        field = "data.path" if isinstance(e, OSError) or data.path else "data.source_options"
        raise ConfigError(field, f"source {data.source!r}: {type(e).__name__}: {_text(e)}") from None
    if not train:
        raise ConfigError("data.eval_size", f"{data.eval_size} leaves no training examples")
    for example in (train[0], *held_out[:1]):
        if is_conversation(example["prompt"]) and not data.chat_template:
            raise ConfigError(
                "data.chat_template",
                f"source {data.source!r} yields conversations (lists of messages); set "
                "data.chat_template=true to render them with the tokenizer's chat template",
            )
        if is_conversation(example["prompt"]):
            continue  # rendered by the tokenizer's template, checked in validate_runtime
        try:
            format_prompt(example, data.template)
        except (KeyError, ValueError, IndexError, AttributeError) as e:
            raise ConfigError("data.template", _text(e)) from None
    return train, held_out


def check_rewards(cfg: Config) -> None:
    """Every reward spec resolves to a function with a valid declared range; a reward that runs code
    (one with a `warmup`, which the pool's workers call first) finds `reward.sandbox` usable here."""
    from rljax.rewards.base import resolve, reward_range

    named = [("reward.functions", name) for name in cfg.reward.functions]
    for key, name in [*named, ("reward.eval_function", cfg.reward.eval_function)]:
        if not isinstance(name, str):
            raise ConfigError(key, f"expected reward names, got {name!r}")
        try:
            fn = resolve(name)
            reward_range(fn, _fitting_options(fn, name, cfg.reward.options_for(name)))
        except ConfigError:
            raise
        except KeyError as e:
            raise ConfigError(key, f"{e.args[0] if e.args else e}") from None
        except (Exception, SystemExit) as e:  # noqa: BLE001 - importing a custom reward runs user code
            raise ConfigError(key, f"{name!r}: {type(e).__name__}: {e}") from None
        if hasattr(fn, "warmup"):
            check_sandbox(cfg.reward.sandbox)


def _fitting_options(fn, name: str, options: dict) -> dict:
    """`options` when `fn` takes every one of them; an unknown key fails here (exit 2), not per call (a
    TypeError from importing a custom reward stays that reward's own error)."""
    try:
        inspect.signature(fn).bind_partial(**options)
    except TypeError as e:
        raise ConfigError("reward.options", f"{name!r}: {e}") from None
    return options


def check_sandbox(mode: str) -> None:
    """`mode` (reward.sandbox) runs here: the same probe the reward workers make at start."""
    from rljax.rewards.sandbox import SandboxUnavailable, sandbox_info

    try:
        sandbox_info(mode)
    except SandboxUnavailable as e:
        raise ConfigError("reward.sandbox", str(e)) from None


def check_env(cfg: Config) -> None:
    """`rollout.env` is empty (single-turn) or a registered environment."""
    if not cfg.rollout.env:
        return
    from rljax.envs import ENVS

    if cfg.rollout.env not in ENVS:
        raise ConfigError(
            "rollout.env",
            f"unknown environment {cfg.rollout.env!r}; valid: '' (single-turn), {', '.join(ENVS.names())}",
        )
