"""Weight sync into a real vLLM server (CPU build): exact log-probs after each update, versions, rejection,
and the canary catching each known CPU pitfall (tied lm_head, stale prefix cache)."""

import numpy as np
import pytest
import requests
from vllm_server import PROBE_PROMPT, TOL, assert_serves_reference, perturbed

from rljax.rollout import RolloutError
from rljax.weight_sync import SyncOptions, WeightSyncer, WeightSyncError
from rljax.weight_sync.canary import canary_prompt_len, server_block_size

pytestmark = pytest.mark.vllm


def _sync_several_updates(served, bucket_bytes: int) -> None:
    base = served.ref.state()
    start = served.engine.version
    # update 1 and 2: plain; 3: with checksums
    variants = [{}, {}, {"checksums": True}]
    for k, extra in enumerate(variants, start=1):
        state = perturbed(base, seed=100 * start + k)
        metrics = served.push(state, start + k, bucket_bytes=bucket_bytes, **extra)
        assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= TOL
        assert (
            metrics["weight_sync/canary_logprob_mean_abs_diff"]
            <= metrics["weight_sync/canary_logprob_max_abs_diff"]
        )
        assert metrics["weight_sync/bytes"] == sum(v.nbytes for v in state.values())
        assert 0 < metrics["weight_sync/pause_seconds"] <= metrics["weight_sync/seconds"]
        assert_serves_reference(served, start + k)


def test_qwen2_tied_several_updates_match_transformers(served_qwen2):
    # 40 KiB buckets: layers split across buckets, several tensors per bucket, the embedding alone.
    _sync_several_updates(served_qwen2, bucket_bytes=40 * 1024)


def test_llama_untied_several_updates_match_transformers(served_llama):
    _sync_several_updates(served_llama, bucket_bytes=100 * 1024)


def test_bad_name_or_shape_rejected_before_pause_and_server_keeps_serving(served_qwen2):
    engine, version = served_qwen2.engine, served_qwen2.engine.version
    good = served_qwen2.ref.state()
    bad_name = {**good, "model.layers.0.mlp.gate_projj.weight": good["model.layers.0.mlp.gate_proj.weight"]}
    with pytest.raises(WeightSyncError, match="gate_projj"):
        engine.push_weights(served_qwen2.weights.snapshot(bad_name.items()), version + 1)
    bad_shape = {**good, "model.norm.weight": np.ones(129, np.float32)}
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*\(129,\)"):
        engine.push_weights(served_qwen2.weights.snapshot(bad_shape.items()), version + 1)
    missing = {k: v for k, v in good.items() if k != "model.layers.1.self_attn.v_proj.bias"}
    with pytest.raises(WeightSyncError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        engine.push_weights(served_qwen2.weights.snapshot(missing.items()), version + 1)
    assert engine.gate.broken is None  # rejected before the pause: the old weights still serve
    assert_serves_reference(served_qwen2, version)


def _unchecked_syncer(engine) -> WeightSyncer:
    """A syncer without the trainer-side name check, so the worker itself must reject."""
    return WeightSyncer(
        engine.urls,
        engine.client.model,
        spec=None,
        canary=engine.syncer.canary,
        gate=engine.gate,
        options=SyncOptions(bucket_bytes=40 * 1024),
        headers=engine.syncer.headers,
    )


@pytest.mark.parametrize(
    "name, array, pattern",
    [
        ("model.layers.0.self_attn.q_proj.weightx", np.zeros((128, 128), np.float32), "unknown tensor"),
        ("model.layers.1.mlp.down_proj.weight", np.zeros((128, 255), np.float32), r"shape \(128, 255\)"),
    ],
)
def test_worker_rejects_bad_tensor_naming_it_then_full_push_recovers(served_qwen2, name, array, pattern):
    engine, version = served_qwen2.engine, served_qwen2.engine.version
    state = served_qwen2.ref.state()
    items = list(state.items())
    items.insert(5, (name, array))  # after some good buckets: the engine holds mixed weights afterwards
    with pytest.raises(WeightSyncError, match=pattern) as err:
        _unchecked_syncer(engine).push_weights(iter(items), version + 1, served_qwen2.ref.logprobs)
    assert name in str(err.value)
    assert engine.gate.broken  # mixed weights: generation refuses instead of sampling from them
    with pytest.raises(RolloutError, match="not servable"):
        engine.generate([PROBE_PROMPT], n=1, temperature=0.0, max_tokens=2)
    served_qwen2.push(perturbed(state, seed=7), version + 1)
    assert_serves_reference(served_qwen2, version + 1)


def test_canary_catches_stale_tied_lm_head_without_the_repack_fix(served_qwen2):
    version, state = served_qwen2.engine.version, served_qwen2.ref.state()
    served_qwen2.engine.syncer.reset()  # re-sends init_info with the fix switched off
    # The stale head shows in both probes; the first-token one runs first.
    with pytest.raises(WeightSyncError, match=r"canary (first token|prompt_logprobs)") as err:
        served_qwen2.push(perturbed(state, seed=11, scale=0.3), version + 1, repack_tied_lm_head=False)
    assert "tolerance" in str(err.value)
    served_qwen2.engine.syncer.reset()  # and back on
    served_qwen2.push(perturbed(state, seed=12), version + 2)
    assert_serves_reference(served_qwen2, version + 2)


def test_canary_is_sized_from_the_servers_kv_block(served_qwen2):
    (url,) = served_qwen2.engine.urls
    assert (
        server_block_size(url, headers=served_qwen2.engine.syncer.headers) == 32
    )  # read from vLLM's /metrics (cache_config_info)
    assert len(served_qwen2.engine.syncer.canary.prompt_ids) == canary_prompt_len(32)
    assert server_block_size("http://127.0.0.1:9") is None  # nothing there: the caller's fall-back


def test_canary_catches_stale_prefix_cache(served_qwen2):
    version, state = served_qwen2.engine.version, served_qwen2.ref.state()
    served_qwen2.push(perturbed(state, seed=21), version + 1)  # its canary fills the prefix cache
    with pytest.raises(WeightSyncError, match=r"canary first token \(prefix cache\)"):
        served_qwen2.push(perturbed(state, seed=22, scale=0.3), version + 2, clear_prefix_cache=False)
    served_qwen2.push(perturbed(state, seed=23), version + 3)
    assert_serves_reference(served_qwen2, version + 3)


def test_update_left_open_by_a_dead_trainer_is_closed_by_the_next_push(served_qwen2):
    version, state = served_qwen2.engine.version, served_qwen2.ref.state()
    (url,) = served_qwen2.engine.urls
    # What a trainer SIGKILLed between /start_weight_update and /finish_weight_update leaves behind.
    headers = served_qwen2.engine.syncer.headers
    requests.post(url + "/start_weight_update", headers=headers, timeout=30).raise_for_status()
    served_qwen2.push(perturbed(state, seed=31), version + 1)
    assert_serves_reference(served_qwen2, version + 1)


def test_sliced_push_is_assembled_by_the_worker(served_qwen2):
    """Sharded staging's blocks (each tensor split by rows over 2 devices, `owned_shards`) are assembled
    into full tensors by the vLLM worker before load_weights; the server then serves the reference."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rljax.weight_sync.staging import owned_shards

    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    state = perturbed(served_qwen2.ref.state(), seed=4242)
    served_qwen2.ref.load(state)
    items = []
    for name, x in state.items():
        spec = PartitionSpec("fsdp") if x.shape[0] % 2 == 0 else PartitionSpec()
        sharded = jax.device_put(x, NamedSharding(mesh, spec))
        items += [(name, d, tuple((s.start, s.stop) for s in i)) for i, d in owned_shards(sharded)]
    assert len(items) > len(state)  # most tensors went as two blocks
    version = served_qwen2.engine.version + 1
    m = served_qwen2.engine.push_weights(served_qwen2.weights.snapshot(items), version)
    assert m["weight_sync/canary_logprob_max_abs_diff"] <= TOL
    assert m["weight_sync/bytes"] >= sum(v.nbytes for v in state.values())
    assert_serves_reference(served_qwen2, version)
