"""One process of the 2-process checkpoint agreement test (tests/test_checkpoint.py).

Usage: python mp_checkpoint_worker.py PROCESS_ID PORT CKPT_DIR OUT.json [BAD_STEP]
Joins a 2-process jax.distributed job (2 CPU devices each), saves steps 1 and 2 of a state sharded over
all 4 devices with real orbax, then restores the latest. With BAD_STEP, this process's read of that step
fails as corrupt bytes do (a DATA_LOSS error from the read) while the other process reads it fine: both
must agree to skip it, restore step 1, and quarantine step 2 exactly once.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
from jax_env import xla_flags  # noqa: E402 (tests/support is the script's directory)

os.environ["XLA_FLAGS"] = xla_flags(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def make_state(seed: int, mesh: Mesh) -> dict:
    w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * (seed + 1)
    sharding = NamedSharding(mesh, P("fsdp", None))
    return {
        "w": jax.make_array_from_callback(w.shape, sharding, lambda idx: w[idx]),
        "step": jax.device_put(jnp.asarray(seed, jnp.int32), NamedSharding(mesh, P())),
    }


def main(process_id: int, port: int, directory: str, out_path: str, bad_step: int | None) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from jax.experimental import multihost_utils

    from rljax import checkpoint

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    ck = checkpoint.Checkpointer(directory, async_save=False)
    for step in (1, 2):
        ck.save(step, make_state(step, mesh), {"k": step}, {})
    ck.wait()
    if bad_step is not None:  # this process alone fails to read the step's bytes
        real = ck._try_restore

        def failing(step, abstract):
            if step != bad_step:
                return real(step, abstract)
            error = ValueError("DATA_LOSS: Error decoding local file (injected on this process)")
            return checkpoint.classify_restore_error(error), None, error

        ck._try_restore = failing
    step, state, extra = ck.restore_latest(checkpoint.abstract_like(make_state(0, mesh)))
    w = multihost_utils.process_allgather(state["w"], tiled=True)
    expected = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * (step + 1)
    result = {
        "step": step,
        "extra": extra,
        "values_match": bool(np.array_equal(np.asarray(w), expected)),
        "all_steps": ck.all_steps(),
        "corrupt": sorted(os.listdir(os.path.join(directory, checkpoint.CORRUPT_DIR)))
        if os.path.isdir(os.path.join(directory, checkpoint.CORRUPT_DIR))
        else [],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    multihost_utils.sync_global_devices("done")
    ck.close()


if __name__ == "__main__":
    bad = int(sys.argv[5]) if len(sys.argv) > 5 else None
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], bad)
