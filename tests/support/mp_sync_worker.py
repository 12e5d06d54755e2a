"""One process of the 2-process x 4-CPU-device sharded weight-sync test
(tests/weight_sync/test_weight_sync_multiprocess.py).

Usage: python mp_sync_worker.py PROCESS_ID PORT CKPT URL TOKEN_FILE OUT_DIR
Joins a jax.distributed job on 127.0.0.1:PORT, loads the tiny checkpoint into a fsdp=4 x tensor=2 mesh
over all 8 devices, perturbs it on device, and pushes it into the vLLM server at URL through the run's
own engine path, `RolloutEngine.push_weights` over `ShardedJaxWeights` (every process stages its own
shards; process 0 pushes), twice: shm, then tcp, where every process serves its own buckets from
its own bucket server (as trainers on several hosts do). Process 0 writes the metrics, the HLO facts
of the sync path's jitted code and the full weights it pushed (gathered after the syncs, for the
reference only) to OUT_DIR/result.pkl; each process writes the bytes its server sent.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
from jax_env import xla_flags  # noqa: E402 (tests/support is the script's directory)

os.environ["XLA_FLAGS"] = xla_flags(4)

import jax  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def perturbed(params, seed: int):
    """params + 0.05 * N(0, 1), computed on each shard's own device (shardings kept)."""
    shardings = jax.tree.map(lambda x: x.sharding, params)
    leaves, treedef = jax.tree.flatten(params)

    def f(leaves):
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        return [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]

    out = jax.jit(f, out_shardings=jax.tree.leaves(shardings))(leaves)
    return jax.tree.unflatten(treedef, out)


def cast_hlo_facts(params) -> dict:
    """The collectives in the compiled HLO of the sync path's one jitted op (the on-device cast to
    bfloat16 of the sharded params) and its per-device bytes."""
    import jax.numpy as jnp

    from rljax import distributed

    compiled = distributed._cast.lower(params, jnp.dtype("bfloat16")).compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    return {
        "collectives": {c: text.count(c) for c in COLLECTIVES},
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
    }


def main(process_id: int, port: int, ckpt: str, url: str, token_file: str, out_dir: str) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert jax.process_count() == 2 and jax.device_count() == 8
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dataclasses
    import functools

    import mp_trainer_common as C
    from jax.experimental import multihost_utils

    from rljax import models
    from rljax.loop.engine import Follower, JaxWeights, ShardedJaxWeights, make_canary_logprobs, push_params
    from rljax.loop.sharded_sync import share_question
    from rljax.rollout import RolloutEngine
    from rljax.rollout.auth import read_token_file
    from rljax.weight_sync import SyncOptions, served
    from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, ShardStager

    cfg, mesh = C.base_config(), C.mesh_of(jax.devices(), 1, 4, 2)
    model_config, params = models.load_hf_checkpoint(ckpt, mesh=mesh)
    params = perturbed(params, seed=7)
    canary = make_canary_logprobs(cfg, model_config, mesh, data_parallel=4)
    spec = models.hf_tensor_specs(model_config)
    stager = ShardStager(DEFAULT_STAGING_DIR, bucket_bytes=64 * 1024, checksums=True, spec=spec)
    engine = None
    if process_id == 0:
        token = read_token_file(token_file)
        sync = SyncOptions(checksums=True)
        engine = RolloutEngine.connect([url], ckpt, sync_options=sync, token=token, max_restarts=1)
    loop = engine if engine is not None else Follower()
    question = share_question(engine.canary if engine is not None else None)
    weights = ShardedJaxWeights(JaxWeights(model_config, canary, question), stager, max_restarts=1)
    results = [push_params(loop, weights, params, 1)]
    serve = functools.partial(
        served.serve_buckets, transport="tcp", hosts="10.255.255.1,127.0.0.1", timeout_s=30
    )
    weights = dataclasses.replace(weights, serve=serve)  # each process serves its own (the first host is not
    if engine is not None:  # this machine's: every process binds the address of its own host, 127.0.0.1)
        engine.syncer.options = dataclasses.replace(engine.syncer.options, transport="tcp")
    params2 = perturbed(params, seed=8)
    with weights.snapshot(params2) as snapshot:
        results.append(loop.push_weights(snapshot, 2))
        kept = snapshot.keep() if engine is not None else None  # what the engine keeps for a recovery
    sent = sum(u.bytes_sent() for u in weights.state.kept)  # this process's server, the tcp push
    if engine is not None:  # a recovery's re-push: the leader alone, the kept files and canary answers
        results.append(engine.pusher.attempt(kept, 2))
    hlo = cast_hlo_facts(params2)
    run_dir = stager._run_dir.path
    leftover = sorted(f for f in os.listdir(run_dir) if not f.startswith("."))
    kept_names = sorted(os.path.basename(b.path) for u in weights.state.kept for b in u.buckets)
    full = multihost_utils.process_allgather(params2, tiled=True)  # the reference only, after the syncs
    if process_id == 0:
        state = dict(models.iter_hf_tensors(model_config, full))
        C.save_pickle(
            {
                "metrics": results,
                "hlo": hlo,
                "state": state,
                "leftover": leftover,
                "kept": kept_names,
                "sent": sent,
            },
            os.path.join(out_dir, "result.pkl"),
        )
    else:
        C.save_pickle(
            {"leftover": leftover, "hlo": hlo, "kept": kept_names, "sent": sent},
            os.path.join(out_dir, "result1.pkl"),
        )
    loop.close()
    weights.close()
    assert not os.path.exists(run_dir), run_dir  # closing removes the staging directory
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])
