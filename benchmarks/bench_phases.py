"""Each phase of an RL step against its floor, in one run: where rljax does work beyond generation + update.

Builds a random-init Qwen2 (default: vocab 4096, hidden 256, 12 layers, 12.9M parameters) and runs, in one
process: (1) the real loop in sync mode (vLLM CPU server, rewards, packing, weight sync with the canary),
`--steps` steps of `--batch` completions x `--max-tokens` tokens of the arithmetic task; (2) the same loop
in async mode (`trainer.max_staleness=1`); (3) the generation floor: vLLM's offline `LLM.generate` on the
same requests (prompts, n, temperature, max tokens, stop tokens, per-request seeds, dtype, KV block, eager,
sampled-token log-probs, cores); (4) the update floor: a bare jitted `jax.value_and_grad` + optax AdamW
step on the same model and the same real tokens without padding (sequences grouped by exact length, one
`[n, len]` array each, loss -mean(A * logp) over completion tokens); rljax's update is also timed outside
the loop on that batch (`update_isolated`).

Ratios (medians of the steps after `--skip`, absolute seconds beside them):
  update = loop timing/update_s vs bare update;  generation = loop rollout/seconds vs offline generate;
  sync step = loop timing/step_s vs generation floor + bare update;
  async step = async loop timing/step_s vs max(generation, update + sync) of the sync loop
  (async_vs_floors: vs max(generation floor, bare update + sync)).
CPU seconds (`cpu_clock`: this process's threads plus the vLLM server's processes) per phase of the
sync loop and per async step: async_vs_core_floor = async step vs (CPU s of generation + update + sync)
/ cores, the least time that work takes on this host however it overlaps; async_vs_bound = vs the larger
of that and max(generation, update + sync).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_phases.py [--steps 10] [--skip 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
from cpu_clock import PhaseCpu, core_floor_s
from phase_floors import (
    alternate,
    bare_update,
    isolated_update,
    make_bare_step,
    make_isolated_update,
    offline_generation,
    step_requests,
)

TARGETS = {"update": 1.15, "generation": 1.2, "sync_step": 1.15, "async_step": 1.1}
MODELS = {
    "13m": dict(
        vocab_size=4096, hidden_size=256, num_layers=12, num_heads=4, num_kv_heads=2, intermediate_size=1024
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128
    ),
}


def build_model(path: Path, size: str) -> Path:
    from rljax.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(path, "qwen2", init_std=0.02, **MODELS[size])


def loop_config(model_path: str, args, max_staleness: int):
    """The default job (configs/grpo.py) on the bench model and batch; no eval, no checkpoints."""
    from configs import grpo
    from rljax import config as C

    cfg = C.from_config_dict(grpo.get_config())
    rows = args.tokens_per_row or cfg.trainer.tokens_per_micro_batch
    return C.validate(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, path=model_path),
            rollout=dataclasses.replace(
                cfg.rollout,
                batch_size=args.batch,
                group_size=args.group,
                max_tokens=args.max_tokens,
                vllm=dataclasses.replace(
                    cfg.rollout.vllm, placement=args.placement, idle_spin_s=args.idle_spin_s
                ),
            ),
            trainer=dataclasses.replace(
                cfg.trainer,
                steps=args.steps,
                eval_every=0,
                max_staleness=max_staleness,
                tokens_per_micro_batch=max(rows, args.max_tokens + 1),
                packed_rows_per_micro_batch=(
                    cfg.trainer.packed_rows_per_micro_batch
                    if args.rows_per_micro < 0
                    else args.rows_per_micro
                ),
            ),
            checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False),
            data=dataclasses.replace(cfg.data, eval_size=8),
            metrics=dataclasses.replace(cfg.metrics, console=False, tensorboard=False),
        )
    )


def run_loop(cfg, workdir: Path) -> list[dict]:
    """Runs `rljax.loop.train` and returns its metrics.jsonl rows (one per step), each with
    `bench/compile_s`: the XLA compile seconds since the previous row (a recompile shows as a spike)."""
    import jax

    from rljax.loop import train as train_module
    from rljax.loop.phases import PhaseTimer

    compiles: list[float] = []
    writes: list[float] = []
    cpu, cpu_rows, timed_phase = PhaseCpu(), [], PhaseTimer.phase

    @contextlib.contextmanager
    def phase(self, name: str):  # the loop's timer, also counting the phase's CPU seconds
        with timed_phase(self, name), cpu.phase(name):
            yield

    def listener(event: str, seconds: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    log_step = train_module.log_step

    def counted_log(*args, **kwargs):  # compile seconds accumulated by each step's metrics line
        writes.append(sum(compiles))
        cpu_rows.append(cpu.step())
        return log_step(*args, **kwargs)

    train_module.log_step, PhaseTimer.phase = counted_log, phase
    try:
        train_module.train(cfg, str(workdir))
    finally:
        train_module.log_step, PhaseTimer.phase = log_step, timed_phase
        jax.monitoring.unregister_event_duration_listener(listener)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r]
    for r, before, after, cpu_s in zip(rows, [0.0, *writes], writes, cpu_rows, strict=False):
        r["bench/compile_s"] = after - before
        r |= cpu_s
    return rows


def synthetic_sequences(args) -> list[tuple[list[int], list[int]]]:
    """`args.batch` (prompt, completion) id lists shaped like the task's: 6-7 prompt tokens and
    `max_tokens - 1` or `max_tokens` completion tokens (a random-init policy rarely stops early)."""
    rng = np.random.default_rng(0)
    vocab = MODELS["tiny" if args.tiny else "13m"]["vocab_size"]
    lengths = [(6 + i % 2, args.max_tokens - 1 + i % 2) for i in range(args.batch)]
    return [(list(rng.integers(10, vocab, p)), list(rng.integers(10, vocab, c))) for p, c in lengths]


def micro_sweep(model: str, args) -> dict:
    """rljax's update at each `--micro-sweep` packed rows per micro-batch vs the bare step, on the same
    synthetic tokens, alternated round by round (so load drifts hit every variant alike). No servers."""
    sequences = synthetic_sequences(args)
    runs = {"bare": make_bare_step(model, sequences)}
    for k in (int(x) for x in args.micro_sweep.split(",")):
        args.rows_per_micro = k
        runs[f"rows_{k}"] = make_isolated_update(loop_config(model, args, 0), sequences)[0]
    times = alternate(runs, args.repeats)
    bare = statistics.median(times["bare"])
    out = {}
    for name, t in times.items():
        out[name] = {"seconds": statistics.median(t), "ratio": statistics.median(t) / bare, "all": t}
        row = out[name]
        print(f"{name:8s} {row['seconds']:7.3f} s {row['ratio']:5.2f}x bare  {[round(x, 3) for x in t]}")
    return out


def med(rows: list[dict], key: str) -> float:
    return float(statistics.median(r.get(key, 0.0) for r in rows))


def summarize(sync_rows, async_rows, gen_floor, bare, isolated) -> dict:
    """The phase table: each phase's seconds, its floor's seconds and their ratio."""
    gen, upd, sync = (
        med(sync_rows, "rollout/seconds"),
        med(sync_rows, "timing/update_s"),
        med(sync_rows, "weight_sync/seconds"),
    )
    g0, u0 = float(statistics.median(gen_floor)), float(statistics.median(bare))
    phases = {
        "update": (upd, u0),
        "update_isolated": (float(statistics.median(isolated[0])), u0),
        "generation": (gen, g0),
        "sync_step": (med(sync_rows, "timing/step_s"), g0 + u0),
    }
    if async_rows:
        phases["async_step"] = (med(async_rows, "timing/step_s"), max(gen, upd + sync))
        phases["async_vs_floors"] = (med(async_rows, "timing/step_s"), max(g0, u0 + sync))
    out = {k: {"seconds": s, "floor_seconds": f, "ratio": s / max(f, 1e-9)} for k, (s, f) in phases.items()}
    for k, t in TARGETS.items():
        if k not in out:
            continue
        out[k]["target"] = t
        out[k]["met"] = out[k]["ratio"] <= t
    parts = ("rollout", "batch", "update", "weight_sync")
    out["sync_loop_parts_s"] = {p: med(sync_rows, f"timing/{p}_s") for p in parts}
    parts = ("stage_seconds", "pause_seconds", "engine_seconds")
    out["sync_loop_parts_s"] |= {k: med(sync_rows, f"weight_sync/{k}") for k in parts}
    keys = ("timing/step_s", "rollout/seconds", "timing/update_s", "weight_sync/seconds")
    keys += ("batch/rows", "batch/row_length", "bench/compile_s")
    out["per_step"] = {
        mode: {k: [r.get(k, 0.0) for r in rows] for k in keys}
        for mode, rows in (("sync", sync_rows), ("async", async_rows))
    }
    out["per_step"]["generation_floor"], out["per_step"]["bare_update"] = list(gen_floor), list(bare)
    out["per_step"]["update_isolated"] = list(isolated[0])
    out["batch/pad_fraction"] = med(sync_rows, "batch/pad_fraction")
    out["batch/pad_fraction_isolated"] = isolated[1]
    out["generated_tokens_per_step"] = med(sync_rows, "rollout/generated_tokens")
    return out


def cpu_summary(sync_rows, async_rows, gen_cpu, bare_cpu, s: dict) -> dict:
    """Each phase's CPU seconds (trainer + server processes) and the core-bound floor of the async step:
    (CPU s of generation + update + sync) / cores, beside max(generation, update + sync) wall seconds."""
    cores = len(os.sched_getaffinity(0))
    loop = {p: med(sync_rows, f"bench/cpu_{p}_s") for p in ("rollout", "update", "weight_sync")}
    loop["step"] = med(sync_rows, "bench/cpu_step_s")
    floors = {"generation": float(np.median(gen_cpu)), "bare_update": float(np.median(bare_cpu))}
    out = {"cpu_seconds": {"cores": cores, "sync_loop": loop, "floors": floors}}
    if not async_rows:
        return out
    step = med(async_rows, "timing/step_s")
    cpu_step = med(async_rows, "bench/cpu_step_s")
    out["cpu_seconds"]["async_loop_step"] = cpu_step
    out["cpu_seconds"]["async_loop_utilization"] = cpu_step / max(step * cores, 1e-9)
    core = core_floor_s([loop["rollout"], loop["update"], loop["weight_sync"]], cores)
    core0 = core_floor_s([floors["generation"], floors["bare_update"], loop["weight_sync"]], cores)
    for key, floor in (("async_vs_core_floor", core), ("async_vs_core_floors", core0)):
        out[key] = {"seconds": step, "floor_seconds": floor, "ratio": step / max(floor, 1e-9)}
    # the async step's bound on this host: it cannot beat either
    bound = max(s["async_step"]["floor_seconds"], core)
    out["async_vs_bound"] = {"seconds": step, "floor_seconds": bound, "ratio": step / max(bound, 1e-9)}
    return out


def print_cpu(s: dict) -> None:
    c = s["cpu_seconds"]
    parts = ", ".join(f"{k}={v:.3f}" for k, v in c["sync_loop"].items())
    print(
        f"CPU s per step (trainer + server, {c['cores']} cores): sync loop {parts}; floors "
        + ", ".join(f"{k}={v:.3f}" for k, v in c["floors"].items())
    )
    if "async_loop_step" not in c:
        return
    print(
        f"async loop: {c['async_loop_step']:.3f} CPU s per step, "
        f"{c['async_loop_utilization']:.0%} of the cores"
    )
    for k in ("async_vs_core_floor", "async_vs_core_floors", "async_vs_bound"):
        row = s[k]
        print(f"{k:<20s} {row['seconds']:9.3f} {row['floor_seconds']:9.3f} {row['ratio']:7.2f}")


def print_table(s: dict, header: str) -> None:
    print(header)
    print(f"{'phase':<16s} {'rljax s':>9s} {'floor s':>9s} {'ratio':>7s}  target")
    for k in ("update", "update_isolated", "generation", "sync_step", "async_step", "async_vs_floors"):
        if k not in s:
            continue
        row = s[k]
        tgt = f"<= {row['target']:.2f} {'met' if row['met'] else 'NOT met'}" if "target" in row else ""
        print(f"{k:<16s} {row['seconds']:9.3f} {row['floor_seconds']:9.3f} {row['ratio']:7.2f}  {tgt}")
    print("sync loop parts (s): " + ", ".join(f"{k}={v:.3f}" for k, v in s["sync_loop_parts_s"].items()))
    for mode in ("sync", "async"):
        steps = s["per_step"][mode]
        if steps["timing/step_s"]:
            rows = [
                f"{int(r)}x{int(n)}"
                for r, n in zip(steps["batch/rows"], steps["batch/row_length"], strict=True)
            ]
            compiles = ", ".join(f"{c:.1f}" for c in steps["bench/compile_s"])
            print(f"{mode} loop packed rows per step: {' '.join(rows)}; compile s per step: {compiles}")
    pad, pad_iso = s["batch/pad_fraction"], s["batch/pad_fraction_isolated"]
    print(f"batch/pad_fraction {pad:.3f} (isolated batch {pad_iso:.3f})")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=3, help="first steps left out (compilation, warm-up)")
    p.add_argument("--batch", type=int, default=32, help="completions per step")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--tokens-per-row",
        type=int,
        default=160,
        help="trainer.tokens_per_micro_batch (0: configs/grpo.py's 64); 160 holds 4 of the task's "
        "37-39 token sequences (pad ~0.05; 64 holds one: pad ~0.41)",
    )
    p.add_argument(
        "--rows-per-micro",
        type=int,
        default=2,
        help="trainer.packed_rows_per_micro_batch (-1: configs/grpo.py's 4, sized for its 64-token "
        "rows); 2 x 160 tokens was the fastest here (2 cores: 1 row 1.07x bare, 2 rows 0.98x, 4 rows "
        "1.07x, the whole batch 1.22x)",
    )
    p.add_argument(
        "--micro-sweep",
        default="",
        help="e.g. 1,2,4,0: only time rljax's update at each trainer.packed_rows_per_micro_batch against "
        "the bare step (synthetic task-shaped tokens, no servers, variants alternated each round)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed bare / isolated updates")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (smoke test)")
    p.add_argument("--skip-async", action="store_true", help="leave out the async loop (one server less)")
    p.add_argument("--placement", default="auto", help="rollout.vllm.placement: auto, none, split")
    p.add_argument("--idle-spin-s", type=float, default=0.002, help="rollout.vllm.idle_spin_s (vLLM's: 1)")
    p.add_argument("--json", default="", help="also write the results here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", "tiny" if args.tiny else "13m"))
        if args.micro_sweep:
            s = {"micro_sweep": micro_sweep(model, args), "loadavg": (load_before, os.getloadavg())}
            print(f"load average (1/5/15 min) {s['loadavg'][0]} -> {s['loadavg'][1]}")
            if args.json:
                Path(args.json).write_text(json.dumps(s, indent=2))
            return s
        sync_cfg = loop_config(model, args, 0)
        sync_rows = run_loop(sync_cfg, Path(tmp) / "sync")[args.skip :]
        async_rows = []
        if not args.skip_async:
            async_rows = run_loop(loop_config(model, args, 1), Path(tmp) / "async")[args.skip :]
        requests = step_requests(sync_cfg, args.steps)
        gen_times, gen_cpu, sequences, idle_cpu = offline_generation(sync_cfg, requests)
        bare, bare_cpu = bare_update(model, sequences, args.repeats)
        isolated = isolated_update(sync_cfg, sequences, args.repeats)
        params = _count_params(Path(model))
    s = summarize(sync_rows, async_rows, gen_times[args.skip :], bare, isolated)
    s |= cpu_summary(sync_rows, async_rows, gen_cpu[args.skip :], bare_cpu, s)
    s["model_params"] = params
    s["offline_engine_cpu_s_in_1s_after_generate"] = idle_cpu
    s["config"] = vars(args) | {
        "tokens_per_micro_batch": sync_cfg.trainer.tokens_per_micro_batch,
        "packed_rows_per_micro_batch": sync_cfg.trainer.packed_rows_per_micro_batch,
    }
    s["host"] = {
        "cpus": len(os.sched_getaffinity(0)),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    header = (
        f"model {params / 1e6:.1f}M params; {args.batch} completions x <= {args.max_tokens} tokens "
        f"({s['generated_tokens_per_step']:.0f} generated); medians of steps {args.skip + 1}..{args.steps}"
    )
    print_table(s, header)
    print_cpu(s)
    print(f"offline engine: {idle_cpu:.2f} CPU s used in the 1 s after its last generate (idle spin)")
    h = s["host"]
    print(f"host: {h['cpus']} cores, load average (1/5/15 min) {h['loadavg_before']} -> {h['loadavg_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2))
    return s


def _count_params(model: Path) -> int:
    import struct

    raw = (model / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    return sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")


if __name__ == "__main__":
    main()
