"""`python -m rljax.eval`: held-out pass@1 and pass@k of a model, or of a run's checkpoint, through vLLM.

    python -m rljax.eval --config=configs/smollm2_math.py --model=DIR [--samples=K] [--json=FILE]
    python -m rljax.eval --workdir=W [--step=S] [--samples=K] [--json=FILE] [--config.<key>=<value> ...]

`--model` is a Hugging Face directory (a fetched or exported model); `--workdir` a training run: its
checkpoint (`--step`, default the latest) is exported (`rljax.export`) into `W/eval/step_<S>/` and evaluated
the same way, with the config the run saved beside it (`--config` replaces it; overrides apply to either).
The prompts are the config's held-out split (`data.eval_size` examples of `data.source`), or every
example of `--data FILE` (jsonl, with the config's `data.prompt_field` / `data.answer_field`).

Sampling is the run's own evaluation: `rollout.eval_temperature`, top-p 1, `rollout.max_tokens`, stop at
EOS, seed `trainer.seed` (prompt i's sample j gets seed + i * K + j), so `--samples=1` reproduces the
run's `eval/accuracy` at the same weights. Each completion is graded by `reward.eval_function` (a score >=
0.5 counts as correct) and by every `reward.functions` entry (the breakdown). It prints one line and,
with `--json`, writes the report: pass@1 (mean over all samples), unbiased pass@k for k = 1, 2, 4, ... <= K
(Chen et al. 2021, arXiv:2107.03374), the mean completion length, the truncation rate and the mean of each
reward. Exit 2 with one line on bad input, before any server starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rljax import config as config_lib
from rljax.runtime import config_from_args, fail, split_config_args


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct of `n` samples: 1 - C(n-c, k) / C(n, k).

    References: Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def ks_for(samples: int) -> list[int]:
    """k = 1, 2, 4, ... up to `samples`, and `samples` itself."""
    ks = [2**i for i in range(int(math.log2(samples)) + 1)]
    return ks if ks[-1] == samples else [*ks, samples]


def summarize(correct: np.ndarray, lengths: np.ndarray, truncated: np.ndarray, rewards: dict) -> dict:
    """The report of bool[P, K] correctness, i32[P, K] lengths, bool[P, K] truncation and {name: f32[P, K]}
    rewards (prompt-major)."""
    prompts, samples = correct.shape
    counts = correct.sum(axis=1)
    return {
        "num_prompts": int(prompts),
        "samples": int(samples),
        "pass@1": float(correct.mean()),
        "pass@k": {
            str(k): float(np.mean([pass_at_k(samples, int(c), k) for c in counts])) for k in ks_for(samples)
        },
        "length_mean": float(lengths.mean()),
        "truncated_fraction": float(truncated.mean()),
        "reward": {name: float(values.mean()) for name, values in rewards.items()},
    }


@dataclasses.dataclass(frozen=True)
class Target:
    """What is evaluated: an HF directory, and where it came from (for the report)."""

    model_dir: str
    source: dict


def load_eval_examples(cfg: config_lib.Config, data_file: str) -> list[dict]:
    """The held-out split of the config's source, or every example of a jsonl `data_file`."""
    from rljax.data import make_source
    from rljax.loop.data_setup import load_examples

    if data_file:
        fields = {"prompt": cfg.data.prompt_field, "answer": cfg.data.answer_field}
        return make_source("jsonl", path=data_file, fields=fields)
    _, held_out = load_examples(cfg.data)
    return held_out


def evaluate(
    cfg: config_lib.Config, target: Target, examples: list[dict], samples: int, logdir: str, dump: str = ""
) -> dict:
    """Serves `target.model_dir` on an owned vLLM server, samples `samples` completions per example the way
    the run's evaluation does, grades them and returns the report (`summarize` plus the source)."""
    from rljax.loop.setup import make_sampler
    from rljax.models.hf import load_tokenizer
    from rljax.rewards import RewardPool
    from rljax.rollout import RolloutEngine
    from rljax.rollout.server import options_from_config

    engine = RolloutEngine.launch(target.model_dir, logdir, server_options=options_from_config(cfg))
    pool = RewardPool(
        [cfg.reward.eval_spec(), *cfg.reward.specs()],
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        sandbox=cfg.reward.sandbox_settings(),
    )
    try:
        sampler = make_sampler(cfg, load_tokenizer(target.model_dir), engine, pool)
        return _sample_and_grade(cfg, sampler, examples, samples, dump) | {"source": target.source}
    finally:
        pool.close()
        engine.close()


def _sample_and_grade(cfg: config_lib.Config, sampler, examples: list[dict], samples: int, dump: str) -> dict:
    completions = sampler.engine.generate(
        [sampler.encode_prompt(ex) for ex in examples],
        n=samples,
        temperature=cfg.rollout.eval_temperature,
        top_p=1.0,
        top_k=0,
        max_tokens=cfg.rollout.max_tokens,
        stop_token_ids=sampler.options.stop_token_ids,
        seed=cfg.trainer.seed,
    )
    completions = sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))
    items = [
        {
            "prompt": sampler.prompt_text(examples[c.prompt_index]),
            "completion": sampler.decode(c.token_ids),
            "example": examples[c.prompt_index],
        }
        for c in completions
    ]
    _, per_function, _ = sampler.rewards.score(items)
    shape = (len(examples), samples)
    names = list(per_function)  # the eval verifier first, then reward.functions in order
    correct = (per_function[names[0]] >= 0.5).reshape(shape)
    lengths = np.array([len(c.token_ids) for c in completions]).reshape(shape)
    truncated = np.array([c.finish_reason == "length" for c in completions]).reshape(shape)
    # named as in reward.functions (the pool suffixes a name it already has: the verifier is often one)
    rewards = {
        fn: per_function[name].reshape(shape)
        for fn, name in zip(cfg.reward.functions, names[1:], strict=True)
    }
    if dump:
        _write_completions(dump, items, correct.reshape(-1))
    return summarize(correct, lengths, truncated, rewards)


def _write_completions(path: str, items: list[dict], correct: np.ndarray) -> None:
    """One jsonl line per completion: prompt, completion, reference answer, correct."""
    with open(path, "w") as f:
        for item, ok in zip(items, correct, strict=True):
            answer = item["example"].get("answer")
            record = {"prompt": item["prompt"], "completion": item["completion"], "answer": answer}
            f.write(json.dumps(record | {"correct": bool(ok)}) + "\n")


def _checkpoint_target(workdir: str, step: int | None) -> tuple[config_lib.Config, Target]:
    """The run's saved config and checkpoint `step` (default: the newest) exported for evaluation into
    `workdir/eval/step_<S>/` (once: the export is renamed into place only when complete)."""
    from rljax import export

    step, step_dir = export.choose_step(workdir, step)
    cfg = export.read_run_config(step_dir)
    out = os.path.join(workdir, "eval", f"step_{step}")
    if not os.path.isdir(out):
        export.export(workdir, out, step=step)
    return cfg, Target(out, {"workdir": os.path.abspath(workdir), "step": step})


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m rljax.eval", description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a Hugging Face model directory")
    which.add_argument("--workdir", help="a training run's directory (its checkpoints)")
    parser.add_argument("--step", type=int, default=None, help="with --workdir: the checkpoint step")
    parser.add_argument("--data", default="", help="a jsonl file of examples instead of the held-out split")
    parser.add_argument("--samples", type=int, default=1, help="completions per prompt (K of pass@k)")
    parser.add_argument("--json", default="", help="write the report here")
    parser.add_argument("--completions", default="", help="write every completion here (jsonl)")
    config_arg, overrides, rest = split_config_args(list(argv))
    config_args = ([f"--config={config_arg}"] if config_arg else []) + [
        f"--config.{k}={v}" for k, v in overrides
    ]
    try:
        return parser.parse_args(rest), config_args
    except SystemExit as e:  # argparse printed its one-line usage error
        sys.exit(2 if e.code else 0)


def _resolve(args: argparse.Namespace, config_args: list[str]) -> tuple[config_lib.Config, Target]:
    """The config and target of the command line (exits 2 on bad input)."""
    if args.samples < 1:
        fail(f"--samples must be >= 1, got {args.samples}")
    if args.step is not None and not args.workdir:
        fail("--step needs --workdir")
    if args.data and not os.path.isfile(args.data):
        fail(f"--data: no such file: {args.data!r}")
    if args.model:
        if not any(a.startswith("--config=") for a in config_args):
            fail("--config is required with --model (the task, reward and sampling settings)")
        from rljax.models.fetch import resolve_model_path

        model = resolve_model_path(
            args.model
        )  # a fetchable name (smollm2-135m-instruct) comes from the cache
        return config_from_args(config_args), Target(model, {"model": os.path.abspath(model)})
    saved, target = _checkpoint_target(args.workdir, args.step)
    cfg = config_from_args(config_args) if any(a.startswith("--config=") for a in config_args) else saved
    return _apply_overrides(cfg, config_args), target


def _apply_overrides(cfg: config_lib.Config, config_args: list[str]) -> config_lib.Config:
    _, overrides, _ = split_config_args(config_args)
    cd = config_lib.to_config_dict(cfg)
    for key, text in overrides:
        *parents, leaf = key.split(".")
        node = cd
        for name in parents:
            node = node[name]
        node[leaf] = config_lib.parse_override(key, text)
    return config_lib.validate(config_lib.from_config_dict(cd))


def main(argv: Sequence[str] | None = None) -> None:
    args, config_args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg, target = _resolve(args, config_args)
        from rljax.loop.inputs import check_model_dir, check_rewards

        check_model_dir(target.model_dir)
        check_rewards(cfg)
        examples = load_eval_examples(cfg, args.data)
    except config_lib.ConfigError as e:
        fail(f"config: {e}")
    except (OSError, ValueError, KeyError) as e:
        fail(f"{type(e).__name__}: {e}")
    if not examples:
        fail("no evaluation examples: data.eval_size is 0 and no --data was given")
    logdir = (
        os.path.join(args.workdir, "eval", "server")
        if args.workdir
        else tempfile.mkdtemp(prefix="rljax-eval-")
    )
    report = evaluate(cfg, target, examples, args.samples, logdir, args.completions)
    ks = " ".join(f"pass@{k} {v:.4f}" for k, v in report["pass@k"].items())
    print(
        f"rljax.eval: {report['num_prompts']} prompts x {args.samples}: {ks}, "
        f"length {report['length_mean']:.1f}, truncated {report['truncated_fraction']:.3f}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
