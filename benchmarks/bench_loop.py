"""One RL step split by phase, and the share that is neither generation nor update math.

Builds a ~13M-parameter Qwen2-style checkpoint (vocab 8192, hidden 256, 10 layers) in a temp dir, runs the
real loop (real vLLM CPU build, real rewards, real weight sync with the canary, real metrics and
checkpoints) for a few steps of 32 completions x 32 tokens, and reports from metrics.jsonl, over the steps
after the first (compile) ones:

  generation   = rollout/seconds (the client's generate call)
  update math  = timing/update_s (old log-probs + optimizer steps, jitted)
  overhead     = timing/step_s - generation - update math
                 (orchestration, rewards, batch building, weight sync, logging, checkpointing)

Printed as ratios of the step time measured in the same run (absolute times are noisy on shared machines).

    .venv/bin/python benchmarks/bench_loop.py [--steps 12] [--skip 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np


def build_model(path: Path) -> Path:
    from rljax.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(
        path,
        "qwen2",
        vocab_size=8192,
        hidden_size=256,
        num_layers=10,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        init_std=0.02,
    )


def bench_config(model_path: str, steps: int):
    from rljax import config as C

    cfg = C.Config()
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=model_path),
        rollout=dataclasses.replace(cfg.rollout, batch_size=32, group_size=4, max_tokens=32),
        trainer=dataclasses.replace(cfg.trainer, steps=steps, eval_every=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=steps),
        data=dataclasses.replace(cfg.data, eval_size=8),
        metrics=dataclasses.replace(cfg.metrics, console=False),
    )


def summarize(rows: list[dict]) -> dict:
    step = np.mean([r["timing/step_s"] for r in rows])
    gen = np.mean([r["rollout/seconds"] for r in rows])
    upd = np.mean([r["timing/update_s"] for r in rows])
    phases = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step_s"})
    out = {"step_s": step, "generation": gen / step, "update_math": upd / step}
    out["overhead"] = 1.0 - out["generation"] - out["update_math"]
    out |= {
        k.removeprefix("timing/").removesuffix("_s"): np.mean([r.get(k, 0.0) for r in rows]) / step
        for k in phases
    }
    out["weight_sync_share"] = np.mean([r["weight_sync/seconds"] for r in rows]) / step
    out["tokens_per_step"] = np.mean([r["rollout/generated_tokens"] for r in rows])
    ws = {k: np.mean([r.get(f"weight_sync/{k}", 0.0) for r in rows]) for k in ("seconds", "stage_seconds")}
    ws["pause_seconds"] = np.mean([r.get("weight_sync/pause_seconds", 0.0) for r in rows])
    out["weight_sync_parts"] = {  # seconds: staging, pause (engine + HTTP), rest (canary: server + trainer)
        "stage_s": ws["stage_seconds"],
        "pause_s": ws["pause_seconds"],
        "canary_s": ws["seconds"] - ws["stage_seconds"] - ws["pause_seconds"],
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (compilation, warm-up)")
    args = parser.parse_args()
    from rljax import config as C
    from rljax.loop.train import train

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        params = sum(int(np.prod(v["shape"])) for v in _header(model).values())
        cfg = C.validate(bench_config(str(model), args.steps))
        train(cfg, str(Path(tmp) / "run"))
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > args.skip]
    s = summarize(rows)
    print(
        f"model: {params / 1e6:.1f}M params; {s['tokens_per_step']:.0f} generated tokens per step "
        f"(32 completions x <= 32 tokens); steps {args.skip + 1}..{args.steps}"
    )
    print(f"step time: {s['step_s']:.3f} s = 1.00")
    for key in ("generation", "update_math", "overhead", "weight_sync_share"):
        print(f"  {key:<20s} {s[key]:6.3f} of the step")
    print(
        "  by phase (share of step): "
        + ", ".join(
            f"{k}={v:.3f}"
            for k, v in s.items()
            if k
            not in (
                "step_s",
                "generation",
                "update_math",
                "overhead",
                "weight_sync_share",
                "tokens_per_step",
                "weight_sync_parts",
            )
        )
    )
    print("  weight sync (s): " + ", ".join(f"{k}={v:.3f}" for k, v in s["weight_sync_parts"].items()))
    print(f"overhead target <= 0.10: {'met' if s['overhead'] <= 0.10 else 'NOT met'} ({s['overhead']:.3f})")


def _header(model: Path) -> dict:
    import struct

    raw = (model / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return {k: v for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}


if __name__ == "__main__":
    main()
