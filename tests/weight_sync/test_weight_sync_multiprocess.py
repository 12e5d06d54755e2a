"""Sharded weight sync in a real multi-process job: 2 JAX processes x 4 CPU devices (jax.distributed on
localhost, fsdp=4 x tensor=2), a real vLLM server. Each process stages only the shards it owns (about
half the model, together exactly all of it), process 0 pushes every process's buckets in one update
(shm, then tcp, where each process serves its own buckets from its own bucket server and sends about
half the bytes), the worker assembles the slices, the canary (the sharded log-prob function on the
mesh) agrees to 1e-4 in float32, and the served log-probs match a transformers reference on the pushed
weights. The sync path's jitted code (the on-device cast) has no collective in its compiled HLO.
The server is the run's shared tiny-Qwen2 one (`served_qwen2`), given its reference weights back after."""

import os

import mp_trainer_common as C
import numpy as np
import pytest
from vllm_server import PROBE_COMPLETION, PROBE_PROMPT, TOL, TorchReference

WORKER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "mp_sync_worker.py"
)
TIMEOUT_S = 500

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess]


@pytest.mark.timeout(TIMEOUT_S + 400)
def test_two_processes_each_stage_their_own_shards_and_the_server_serves_them(served_qwen2, tmp_path):
    from rljax.rollout.auth import bearer_headers
    from rljax.rollout.server import served_model_name
    from rljax.weight_sync.canary import server_prompt_logprobs

    ckpt, server = served_qwen2.path, served_qwen2.server
    try:
        args = [ckpt, server.url, str(server.token_file), str(tmp_path)]
        C.run_two_processes(WORKER, args, tmp_path, TIMEOUT_S)
        out, out1 = C.load_pickle(str(tmp_path / "result.pkl")), C.load_pickle(str(tmp_path / "result1.pkl"))
        model_bytes = sum(v.nbytes for v in out["state"].values())  # float32: the serving dtype here
        assert len(out["metrics"]) == 3  # shm, tcp, then a recovery's re-push of the kept tcp push
        for m in out["metrics"][:2]:
            lo, hi = m["weight_sync/staged_bytes_min_process"], m["weight_sync/staged_bytes_max_process"]
            assert lo + hi == model_bytes  # together exactly the model, each element once
            assert hi <= 0.55 * model_bytes
        for m in out["metrics"]:
            assert m["weight_sync/canary_logprob_max_abs_diff"] <= TOL
        assert out["metrics"][2]["weight_sync/bytes"] == out["metrics"][1]["weight_sync/bytes"]
        # tcp: each process's own bucket server sent its own buckets, once (one rollout node), nothing else
        pushed = out["metrics"][1]["weight_sync/bytes"]
        assert out["sent"] + out1["sent"] == pushed and max(out["sent"], out1["sent"]) <= 0.55 * pushed
        assert out["metrics"][1]["weight_sync/sent_before_pause"] == 1.0  # both processes reported it
        assert "weight_sync/sent_before_pause" not in out["metrics"][0]  # shm: nothing streamed
        ref = TorchReference(ckpt)
        ref.load(out["state"])
        headers = bearer_headers(server.token)
        model = served_model_name(server.url, headers=headers)
        got = server_prompt_logprobs(server.url, model, PROBE_PROMPT, PROBE_COMPLETION, headers=headers)
        np.testing.assert_allclose(got, ref.logprobs(PROBE_PROMPT, PROBE_COMPLETION), atol=TOL, rtol=0)
        for hlo in (out["hlo"], out1["hlo"]):
            assert hlo["collectives"] == dict.fromkeys(hlo["collectives"], 0), hlo
            assert hlo["output_bytes"] <= 0.55 * hlo["argument_bytes"]  # float32 -> bfloat16, own shards only
            assert hlo["argument_bytes"] < model_bytes / 2  # no device holds a full copy of the model
        # with restarts allowed each process keeps exactly its last push's buckets (for a re-push)
        for o in (out, out1):
            assert o["leftover"] == o["kept"] and o["kept"], o
    finally:  # the next test of the shared server expects the reference weights at the engine's version
        served_qwen2.engine.push_weights(
            served_qwen2.weights.snapshot(served_qwen2.ref.state().items()), served_qwen2.engine.version
        )
