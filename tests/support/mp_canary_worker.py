"""One process of the 2-process x 4-CPU-device single-canary-path test (tests/weight_sync/
test_canary_single_path.py).

Usage: python mp_canary_worker.py PROCESS_ID PORT CKPT OUT_DIR
Counts every call into the training path's log-prob function (`rljax.trainer.make_logprob_fn`'s
result) and takes snapshots through both multi-process layouts of `rljax.loop.engine`'s
`ShardedJaxWeights`: each process serving its own buckets over tcp (trainers on several hosts) and mapped
files (one host). The canary's question is fixed, so every process answers it together when the snapshot
is taken; the leader then reads the answer (what check_canary asks) and the kept snapshot's answer (a
recovery's re-push). Each process writes its counts and the leader's answers
to OUT_DIR/canary<i>.pkl.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
from jax_env import xla_flags  # noqa: E402 (tests/support is the script's directory)

os.environ["XLA_FLAGS"] = xla_flags(4)

import jax  # noqa: E402


def main(process_id: int, port: int, ckpt: str, out_dir: str) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dataclasses
    import functools

    import mp_trainer_common as C
    import numpy as np

    from rljax import models, trainer
    from rljax.loop import engine
    from rljax.weight_sync import served
    from rljax.weight_sync.canary import make_canary
    from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, ShardStager

    calls = []
    trainer.make_logprob_fn = C.counting_logprob_fn(trainer.make_logprob_fn, calls)
    cfg, mesh = C.base_config(), C.mesh_of(jax.devices(), 1, 4, 2)
    model_config, params = models.load_hf_checkpoint(ckpt, mesh=mesh)
    canary = engine.make_canary_logprobs(cfg, model_config, mesh, data_parallel=4)
    spec = make_canary(model_config.vocab_size, prompt_len=20, completion_len=6)
    prompt, completion = list(spec.prompt_ids), list(spec.completion_ids)
    spec_hf = models.hf_tensor_specs(model_config)
    stager = ShardStager(DEFAULT_STAGING_DIR, bucket_bytes=64 * 1024, checksums=True, spec=spec_hf)
    serve = functools.partial(served.serve_buckets, transport="tcp", hosts="127.0.0.1", timeout_s=30)
    sharded = engine.ShardedJaxWeights(engine.JaxWeights(model_config, canary, spec), stager, max_restarts=1)
    layouts = {  # trainers on several hosts serve their own buckets (tcp); on one host the servers map them
        "multi_host": dataclasses.replace(sharded, serve=serve),
        "one_host": sharded,
    }
    out = {"calls": {}, "answers": {}, "kept": {}}
    for name, weights in layouts.items():
        seen = {}
        before = len(calls)
        with weights.snapshot(params) as snapshot:  # every process: its shards and the canary's answer
            if process_id == 0:  # the leader's push: what check_canary asks, what the engine keeps
                seen["answer"] = np.asarray(snapshot.logprobs(prompt, completion))
                seen["kept"] = snapshot.keep()
        out["calls"][name] = len(calls) - before
        if process_id == 0:
            out["answers"][name] = seen["answer"]
            before = len(calls)  # a recovery: the leader alone, no collective, no new forward
            out["kept"][name] = np.asarray(seen["kept"].logprobs(prompt, completion))
            out["calls"][name + "_recovery"] = len(calls) - before
    direct = canary(params)(prompt, completion)  # a collective: both processes
    out["direct"] = np.asarray(direct)
    weights.close()
    C.save_pickle(out, os.path.join(out_dir, f"canary{process_id}.pkl"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5])
