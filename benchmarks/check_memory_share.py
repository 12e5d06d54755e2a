"""Does JAX take the share of the GPU the device plan gave it? One line of JSON (the GPU check's `plan` step).

    python benchmarks/check_memory_share.py --gpus 1 [--json OUT] -- <rljax.main args>

Asks `rljax.launch --plan-env` for the trainer's share (XLA_PYTHON_CLIENT_MEM_FRACTION) of a job colocated
with its server on `--gpus` GPUs, starts a fresh Python with exactly that environment, and reads JAX's pool
limit there (`memory_stats()["bytes_limit"]`) against the device's total memory (`nvidia-smi`). The plan is
honoured when the limit is the share of the total to within `--tolerance` (default 0.02 of the device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROBE = "import jax, json; print(json.dumps(jax.devices()[0].memory_stats()))"


def planned_share(gpus: int, args: list[str]) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "rljax.launch", "--plan-env", "--gpus", str(gpus), "--", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"])


def total_bytes() -> int:
    """GPU 0's memory from nvidia-smi (MiB)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return int(out.strip().splitlines()[0]) * 2**20


def compare(share: float, bytes_limit: int, total: int, tolerance: float) -> dict:
    taken = bytes_limit / total
    return {"planned": share, "taken": round(taken, 4), "honoured": abs(taken - share) <= tolerance}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--json")
    opts = p.parse_args(ours)
    share = planned_share(opts.gpus, rest or ["--config=configs/grpo.py"])
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{share:.2f}")
    stats = json.loads(
        subprocess.run(
            [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    report = compare(share, int(stats["bytes_limit"]), total_bytes(), opts.tolerance)
    print(json.dumps(report))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f)
    return 0 if report["honoured"] else 1


if __name__ == "__main__":
    sys.exit(main())
