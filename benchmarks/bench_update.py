"""rljax's update against Tunix's and a plain JAX/optax one, on the same model, tokens and optimizer.

Command (2-core CPU: ~2 min for `--model small`, ~1 min for `tiny`):
    .venv/bin/python benchmarks/bench_update.py [--model tiny|small] [--rounds 12] [--json out.json]
        [--variant NAME:field=value,...]... [--no-tunix]
Tunix (a benchmark dependency only; its own requirements would replace this environment's transformers,
so install it beside, without them):
    .venv/bin/pip install --no-deps --target .bench-pkgs google-tunix==0.1.7 google_metrax perfetto \
        jaxtyping wadler_lindig
    PYTHONPATH=.bench-pkgs .venv/bin/python benchmarks/bench_update.py ...
Models (random-init Qwen2, written as HF safetensors by rljax.models.tiny, read by all three):
`tiny` (vocab 512, d 128, 2 layers, 4/2 heads, MLP 256, tied: 0.36M params) and `small` (vocab 4096,
d 512, 4 layers, 8/2 heads, MLP 1408, tied: 13.4M). Batch: `--rows` 32 sequences of `--prompt-len` 8 prompt
tokens + `--completion-len` 32 completion tokens (every completion full length), one GRPO group per
`--group` 8 rows (sharing its prompt), random advantages; beta 0, on-policy (old log-probs from the same
forward), one optimizer step per update, global-norm clipping 1.0 + AdamW.

- rljax: `trainer.make_update` + `trainer.prepare_batch` (what the loop runs each step, host batch
  preparation and the metrics fetch included) with the default job's config (configs/grpo.py) on this model;
  sequences packed one per row (`trainer.tokens_per_micro_batch` = prompt + completion) and the whole batch
  in one micro-batch (`packed_rows_per_micro_batch=0`). `--variant` adds rljax runs with other settings
  (`model.*` / `trainer.*` fields, e.g. `blockwise:model.attention_impl=blockwise`, or
  `shared:trainer.tokens_per_micro_batch=272,trainer.share_prompts=true`: each group's 8 completions with
  one copy of their prompt in a 272-token row; the peers process every prompt copy).
- tunix: Tunix's own Qwen2, GRPO loss and train-step body (benchmarks/tunix_update.py).
- plain: a plain JAX/optax implementation written for speed (benchmarks/plain_update.py).

The implementations alternate call by call (each round runs each once), so load drifts on a shared
machine hit all of them alike; the first two rounds compile and are dropped. Prints each one's median
seconds and the ratios rljax / tunix and rljax / plain (targets: <= 1.0 and <= 1.1).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "tiny": dict(
        vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256
    ),
    "small": dict(
        vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1408
    ),
}  # fmt: skip
TARGETS = {"tunix": 1.0, "plain": 1.1}


def synthetic_batch(args, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompts i32[B,P], completions i32[B,C], advantages f32[B] standardized per group); the rows of a
    group share their prompt, as in GRPO."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, vocab, (args.rows // args.group, args.prompt_len)).astype(np.int32)
    prompts = np.repeat(prompts, args.group, axis=0)
    completions = rng.integers(10, vocab, (args.rows, args.completion_len)).astype(np.int32)
    rewards = rng.standard_normal((args.rows // args.group, args.group))
    adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
    return prompts, completions, adv.reshape(-1).astype(np.float32)


def rljax_config(model_path: str, args, overrides: dict):
    """The default job's config on the bench model and batch (see the module docstring)."""
    from configs import grpo
    from rljax import config as C

    d = grpo.get_config()
    settings = {
        "model.path": model_path,
        "rollout.batch_size": args.rows,
        "rollout.group_size": args.group,
        "rollout.max_tokens": args.completion_len,
        "trainer.tokens_per_micro_batch": args.prompt_len + args.completion_len,
        "trainer.packed_rows_per_micro_batch": 0,
    }
    for key, value in (settings | overrides).items():  # on the ConfigDict: its field types check them
        *parents, field = key.split(".")
        setattr(functools.reduce(getattr, parents, d), field, value)
    return C.validate(C.from_config_dict(d))


def parse_variant(text: str) -> tuple[str, dict]:
    """ "name:section.field=value,..." -> (name, {"section.field": value}) with ints/floats/bools parsed."""
    name, _, spec = text.partition(":")
    out = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=", 1)
        if value in ("true", "false"):
            out[key] = value == "true"
            continue
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        out[key] = value
    return name, out


def make_rljax_update(cfg, prompts, completions, adv):
    from phase_floors import make_isolated_update

    sequences = [(list(p), list(c)) for p, c in zip(prompts.tolist(), completions.tolist(), strict=True)]
    return make_isolated_update(cfg, sequences, advantages=adv)[0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--model-path", default="", help="an existing HF checkpoint instead (e.g. SmolLM2's)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--variant", action="append", default=[], help="NAME:section.field=value,...")
    p.add_argument("--no-tunix", action="store_true", help="leave Tunix out even when installed")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)

    from rljax.models.tiny import build_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        if args.model_path:
            path = Path(args.model_path)
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            args.no_tunix |= "Qwen2" not in (path / "config.json").read_text()  # Tunix's qwen2 module only
        else:
            path = build_tiny_checkpoint(Path(tmp) / args.model, init_std=0.02, **MODELS[args.model])
            vocab = MODELS[args.model]["vocab_size"]
        out = measure(args, path, vocab)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def measure(args, path: Path, vocab: int) -> dict:
    """Builds every run on the checkpoint at `path`, alternates them and prints the table."""
    from phase_floors import alternate
    from plain_update import make_plain_update
    from tunix_update import make_tunix_update, tunix_available

    prompts, completions, adv = synthetic_batch(args, vocab)
    runs = {"rljax": make_rljax_update(rljax_config(str(path), args, {}), prompts, completions, adv)}
    for text in args.variant:
        name, overrides = parse_variant(text)
        runs[name] = make_rljax_update(rljax_config(str(path), args, overrides), prompts, completions, adv)
    if tunix_available() and not args.no_tunix:
        runs["tunix"] = make_tunix_update(path, prompts, completions, adv)
    else:
        print("tunix: not installed or not asked for (see this script's docstring); its column is left out")
    runs["plain"] = make_plain_update(path, prompts, completions, adv)
    times = alternate(runs, args.rounds)
    median = {name: statistics.median(t) for name, t in times.items()}
    out = {"model": args.model, "args": vars(args), "seconds": median, "all": times, "ratios": {}}
    for name, seconds in median.items():
        ratios = {peer: seconds / median[peer] for peer in TARGETS if peer in median and peer != name}
        out["ratios"][name] = ratios
        shown = "  ".join(f"{r:.2f}x {peer}" for peer, r in ratios.items())
        print(f"{name:12s} {seconds:8.4f} s  {shown}")
    for peer, target in TARGETS.items():
        if peer in median:
            ratio = median["rljax"] / median[peer]
            print(f"rljax / {peer}: {ratio:.2f} (target <= {target}) {'ok' if ratio <= target else 'MISSED'}")
    return out


if __name__ == "__main__":
    main()
