"""Per-device memory of the trainer at real shapes, compiled for N simulated CPU devices (nothing allocated).

Command (compile only: about 30 s for the 7B at 8k on 2 CPU cores, a few GB of host memory):
    .venv/bin/python benchmarks/bench_memory.py --model qwen2.5-7b --devices 8 --mesh fsdp=8 \\
        --seq-len 8192 --rollouts 512 --beta 0.04 --json /tmp/mem.json
Shapes come from rljax.models.presets (random weights are never materialized). f32 master params, bf16
compute, AdamW, remat `--remat` (the config default "full"), attention `--attention` (default "auto").
The train step gets one micro-batch of `--tokens-per-device` tokens per device (default: the sequence
length, one sequence per device) out of the whole rollout batch, i.e. gradient accumulation over
`rollouts / micro_batch_size` micro-batches, plus the optimizer update; `old_logprobs` runs over the
whole rollout batch; `ref_logprobs` (with `--beta` > 0) is the same executable on the reference copy
(compiled once; it differs in what else the device holds, `resident`). `--lora-rank R`: LoRA (alpha 2R) on
the attention and MLP projections: the train state is the adapter (f32, AdamW), the frozen base an argument
in bf16, and the reference is the base itself.
Prints a table and writes JSON: `train_step_bytes`, `old_logprobs_bytes`, `ref_logprobs_bytes` (each
argument + output + temp - alias from `compiled.memory_analysis()`, per device), `train_step_temp_bytes`,
`<function>_compile_s`, the per-function details and the inputs. Good looks like: the 7B at fsdp=8, 8192 x
512 under 48 GiB (train step) and 16 GiB (old log-probs) per device, and the temp at 16384 at most 2.2x
that at 8192.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

GIB = 1024**3
FUNCTIONS = ("train_step", "old_logprobs", "ref_logprobs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=("qwen2.5-0.5b", "qwen2.5-7b", "llama3-8b"))
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    ap.add_argument("--mesh", default="fsdp=8", help="axis=size pairs, e.g. fsdp=8,tensor=1 (data: the rest)")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per row (the longest bucket)")
    ap.add_argument("--rollouts", type=int, required=True, help="rows per rollout batch")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 adds the reference pass")
    ap.add_argument("--tokens-per-device", type=int, default=0, help="train micro-batch tokens per device")
    ap.add_argument("--remat", default="full", help="a name in rljax.models.REMAT_POLICIES")
    ap.add_argument("--attention", default="auto", help="a name in rljax.models.ATTENTION_IMPLS or auto")
    ap.add_argument("--family", default="grpo", choices=("grpo", "ppo"))
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (alpha 2r); 0: full fine-tuning")
    ap.add_argument("--hlo-dir", default="", help="also write each function's compiled HLO text here")
    ap.add_argument("--json", default="", help="write the results here")
    return ap.parse_args(argv)


def mesh_sizes(text: str, devices: int) -> dict[str, int]:
    """`fsdp=8,tensor=2` -> {data, fsdp, tensor} over `devices` (data takes the rest)."""
    sizes = {"data": -1, "fsdp": 1, "tensor": 1}
    for part in filter(None, text.split(",")):
        axis, _, size = part.partition("=")
        if axis not in sizes or not size.isdigit():
            sys.exit(f"--mesh: bad entry {part!r}; expected data=N, fsdp=N or tensor=N")
        sizes[axis] = int(size)
    if sizes["data"] == -1:
        rest = sizes["fsdp"] * sizes["tensor"]
        if devices % rest:
            sys.exit(f"--mesh {text}: fsdp*tensor = {rest} does not divide {devices} devices")
        sizes["data"] = devices // rest
    if math.prod(sizes.values()) != devices:
        sys.exit(f"--mesh {text}: data*fsdp*tensor = {math.prod(sizes.values())}, not {devices} devices")
    return sizes


def make_config(args: argparse.Namespace, sizes: dict[str, int]):
    """The run Config for these shapes (validated like a user's config)."""
    from rljax import config as config_lib

    seq_len, tokens = args.seq_len, args.tokens_per_device or args.seq_len
    if tokens % seq_len:
        sys.exit(f"--tokens-per-device {tokens} must be a multiple of --seq-len {seq_len} (whole rows)")
    micro = sizes["data"] * sizes["fsdp"] * (tokens // seq_len)
    if args.rollouts % micro:
        sys.exit(f"--rollouts {args.rollouts} must be a multiple of the micro-batch of {micro} rows")
    cfg = config_lib.Config()
    cfg = dataclasses.replace(
        cfg,
        algo=dataclasses.replace(cfg.algo, family=args.family, beta=args.beta),
        model=dataclasses.replace(
            cfg.model,
            param_dtype="float32",
            compute_dtype="bfloat16",
            remat=args.remat,
            attention_impl=args.attention,
            lora_rank=args.lora_rank,
            lora_alpha=2.0 * max(args.lora_rank, 1),
        ),
        rollout=dataclasses.replace(
            cfg.rollout,
            batch_size=args.rollouts,
            group_size=math.gcd(args.rollouts, 8),
            vllm=dataclasses.replace(cfg.rollout.vllm, max_model_len=seq_len),
        ),
        optim=dataclasses.replace(cfg.optim, name="adamw"),
        mesh=dataclasses.replace(cfg.mesh, **sizes),
        trainer=dataclasses.replace(cfg.trainer, micro_batch_size=micro, minibatches=1),
    )
    try:
        return config_lib.validate(cfg)
    except config_lib.ConfigError as e:
        sys.exit(f"config: {e}")


def print_table(report: dict, header: str) -> None:
    print(header)
    cols = ("argument", "output", "temp", "alias", "peak", "resident", "total")
    print(f"{'function':<14}" + "".join(f"{c + ' GiB':>14}" for c in cols) + f"{'compile s':>11}")
    for name, m in report.items():
        d = m.as_dict()
        row = "".join(f"{d[c + '_bytes'] / GIB:>14.2f}" for c in cols)
        print(f"{name:<14}{row}{m.compile_s:>11.1f}")


def results(args, sizes: dict[str, int], cfg, report: dict, wall_s: float) -> dict:
    out = {
        "model": args.model,
        "devices": args.devices,
        "mesh": sizes,
        "seq_len": args.seq_len,
        "rollouts": args.rollouts,
        "beta": args.beta,
        "family": args.family,
        "lora_rank": args.lora_rank,
        "tokens_per_device": args.tokens_per_device or args.seq_len,
        "micro_batch_size": cfg.trainer.micro_batch_size,
        "remat": cfg.model.remat,
        "attention": cfg.model.attention_impl,
        "param_dtype": cfg.model.param_dtype,
        "compute_dtype": cfg.model.compute_dtype,
        "train_step_temp_bytes": report["train_step"].temp_bytes,
        "wall_s": wall_s,
        "functions": {name: m.as_dict() for name, m in report.items()},
    }
    for name in FUNCTIONS:
        m = report.get(name)
        out[f"{name}_bytes"] = None if m is None else m.peak_bytes
        out[f"{name}_compile_s"] = None if m is None else m.compile_s
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # The simulated device count must be set before JAX starts: everything that imports jax comes after.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sizes = mesh_sizes(args.mesh, args.devices)
    cfg = make_config(args, sizes)
    from rljax import memory
    from rljax.models.presets import PRESETS
    from rljax.sharding import make_mesh

    start = time.perf_counter()
    report = memory.compiled_train_memory(
        cfg,
        PRESETS.get(args.model),
        make_mesh(**sizes),
        memory.TrainShapes(rows=args.rollouts, seq_len=args.seq_len, train_rows=args.rollouts),
        with_hlo=bool(args.hlo_dir),
    )
    out = results(args, sizes, cfg, report, time.perf_counter() - start)
    print_table(
        report, f"{args.model} x {args.rollouts} rows x {args.seq_len} tokens, mesh {sizes}, per device:"
    )
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        for name in ("train_step", "old_logprobs"):
            with open(os.path.join(args.hlo_dir, f"{name}.hlo.txt"), "w") as f:
                f.write(report[name].hlo)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
