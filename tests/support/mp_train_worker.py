"""One process of the 2-process x 4-CPU-device train-step test (tests/loop/test_train_multiprocess.py).

Usage: python mp_train_worker.py PROCESS_ID PORT INPUT.pkl OUTPUT.pkl
Joins a jax.distributed job on 127.0.0.1:PORT, builds the global batch from this process's rows with
jax.make_array_from_process_local_data, runs the gradient and one train step on a fsdp=4 x tensor=2
mesh over all 8 devices, and (process 0) writes loss, grads and updated params to OUTPUT.pkl.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
from jax_env import xla_flags  # noqa: E402 (tests/support is the script's directory)

os.environ["XLA_FLAGS"] = xla_flags(4)

import jax  # noqa: E402


def local_rows(mesh, rows: int) -> slice:
    """The contiguous block of batch rows this process's devices hold."""
    from rljax.trainer import batch_sharding

    index_map = batch_sharding(mesh).addressable_devices_indices_map((rows,))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop or rows for idx in index_map.values()})
    block = slice(starts[0], stops[-1])
    assert stops[-1] - starts[0] == sum(b - a for a, b in zip(starts, stops, strict=True)), (
        "rows not contiguous"
    )
    return block


def main(process_id: int, port: int, in_path: str, out_path: str) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mp_trainer_common as C
    from jax.experimental import multihost_utils

    from rljax import trainer
    from rljax.trainer.step import make_grad_fn

    inputs = C.load_pickle(in_path)
    cfg, mesh = C.base_config(), C.mesh_of(jax.devices(), 1, 4, 2)
    # Loaded straight into the mesh's shardings: each process reads only its own shards.
    model_config, params = C.load(inputs["ckpt"], mesh)
    rows = local_rows(mesh, C.ROWS)
    local = jax.tree.map(lambda x: x[rows], inputs["batch"])
    batch = trainer.shard_local_batch(local, mesh)
    assert batch.inputs.input_ids.shape == (C.ROWS, C.LENGTH) and not batch.old_logp.is_fully_addressable
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    grads, _ = make_grad_fn(cfg, model_config, mesh)(state.params, batch)
    new_state, metrics = trainer.make_train_step(cfg, model_config, mesh)(state, batch)
    out = multihost_utils.process_allgather(
        {"grads": grads, "new_params": new_state.params, "metrics": metrics}, tiled=True
    )
    if process_id == 0:
        C.save_pickle(C.to_host(out), out_path)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
