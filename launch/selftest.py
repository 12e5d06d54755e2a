"""Launch self-test: checks a launch path (Slurm or rljax.launch) end to end without the trainer.

    RLJAX_ENTRY=launch/selftest.py sbatch --ntasks=2 launch/gpu_slurm.sh -- --config=configs/grpo.py:smoke \
        --workdir=/shared/selftest

Takes the same arguments as `rljax.main`, joins the JAX job through `rljax.runtime.initialize_jax` (so it
prints the same start-up line), then runs `trainer.steps` steps of a collective sum over every device,
`RLJAX_SELFTEST_STEP_S` seconds apart (default 1). Process 0 appends one JSON line per step to
<workdir>/selftest_metrics.jsonl and saves the step to <workdir>/selftest_checkpoint.json every
`checkpoint.every_steps` steps and at the end. On SIGTERM/SIGUSR1 all processes agree (through the same
collective) to stop at the step boundary, save, and exit 143, like the training loop; a restart with the
same workdir resumes from the saved step. A wrong collective sum exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

PREEMPTED_EXIT_CODE = 143


def main() -> int:
    from rljax import runtime
    from rljax.launch import workdir_of

    cfg = runtime.config_from_args(sys.argv[1:])

    workdir = workdir_of(sys.argv[1:])
    runtime.initialize_jax()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    requested = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _: requested.append(signum))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("d",))
    in_sharding = NamedSharding(mesh, PartitionSpec("d"))
    total = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))

    def all_sum(stop: bool) -> np.ndarray:  # (sum of process_index + 1 over devices, devices asking to stop)
        local = np.tile(
            np.asarray([[jax.process_index() + 1, float(stop)]], np.float32), (jax.local_device_count(), 1)
        )
        return np.asarray(total(jax.make_array_from_process_local_data(in_sharding, local)))

    expected = float(sum(p + 1 for p in range(jax.process_count())) * jax.local_device_count())
    ckpt = os.path.join(workdir, "selftest_checkpoint.json")
    step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
    if step:
        print(f"rljax-selftest: resuming from step {step}", flush=True)
    while step < cfg.trainer.steps:
        time.sleep(float(os.environ.get("RLJAX_SELFTEST_STEP_S", "1")))
        value, stops = all_sum(bool(requested))
        if value != expected:
            print(f"rljax-selftest: collective sum {value} != {expected}", file=sys.stderr, flush=True)
            return 1
        step += 1
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "selftest_metrics.jsonl"), "a") as f:
                f.write(
                    json.dumps({"step": step, "sum": float(value), "processes": jax.process_count()}) + "\n"
                )
        if stops or step == cfg.trainer.steps or step % cfg.checkpoint.every_steps == 0:
            _save(ckpt, step)
            all_sum(False)  # barrier: nobody exits before process 0 has written the checkpoint
        if stops:
            print(f"rljax-selftest: preempted; saved step {step}, exiting for requeue", flush=True)
            return PREEMPTED_EXIT_CODE
    print(f"rljax-selftest: finished {step} steps", flush=True)
    return 0


def _save(path: str, step: int) -> None:
    import jax

    if jax.process_index() == 0:
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
