"""Rollout client against a real vLLM server (CPU build): token ids, versions, the processed log-prob
convention vs transformers, stop tokens, seeds, replicas and retries."""

import time

import numpy as np
import pytest

from rljax.rollout import ClientOptions, RolloutClient, RolloutError, free_port

# vLLM's CPU kernels and transformers accumulate float32 in different orders: ~5e-6 measured.
TOL = 1e-4
PROMPTS = [[5, 17, 300, 42, 9], [100, 7, 7, 256], [3, 1, 4, 1, 5, 9, 2, 6]]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.vllm
def test_generate_orders_tags_and_returns_processed_logprobs_at_temperature(served_qwen2):
    engine = served_qwen2.engine
    out = engine.generate(PROMPTS, n=3, temperature=0.7, top_p=1.0, top_k=0, max_tokens=6, seed=1)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(3) for j in range(3)]
    for c in out:
        assert c.prompt_ids == tuple(PROMPTS[c.prompt_index])
        assert c.policy_version == engine.version
        assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) == len(c.logprobs) <= 6
        # processed log-probs: log_softmax(logits / T), exactly what the trainer computes
        want = served_qwen2.ref.logprobs(list(c.prompt_ids), list(c.token_ids), temperature=0.7)
        np.testing.assert_allclose(c.logprobs, want, atol=TOL, rtol=0)
    m = engine.metrics()
    assert m["rollout/policy_version"] == engine.version and m["rollout/tokens_per_s"] > 0


@pytest.mark.vllm
def test_top_k_logprobs_are_renormalised_over_the_kept_tokens(served_qwen2):
    (c,) = served_qwen2.engine.generate([PROMPTS[0]], n=1, temperature=1.0, top_k=4, max_tokens=5, seed=3)
    logits = served_qwen2.ref.logits(list(c.prompt_ids) + list(c.token_ids))[len(c.prompt_ids) - 1 : -1]
    for j, tok in enumerate(c.token_ids):
        kept = np.argsort(logits[j])[-4:]
        assert tok in kept
        np.testing.assert_allclose(
            c.logprobs[j], _log_softmax(logits[j][kept])[list(kept).index(tok)], atol=TOL
        )


@pytest.mark.vllm
def test_greedy_stop_tokens_and_seeds(served_qwen2):
    engine = served_qwen2.engine
    (g,) = engine.generate([PROMPTS[1]], n=1, temperature=0.0, max_tokens=6)
    np.testing.assert_allclose(g.logprobs, served_qwen2.ref.logprobs(PROMPTS[1], list(g.token_ids)), atol=TOL)
    stop = g.token_ids[2]
    cut = list(g.token_ids).index(stop) + 1
    (s,) = engine.generate([PROMPTS[1]], n=1, temperature=0.0, max_tokens=6, stop_token_ids=[stop])
    assert s.finish_reason == "stop" and s.token_ids == g.token_ids[:cut]  # the stop token is kept
    a = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8, seed=5)
    b = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8, seed=5)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


@pytest.mark.vllm
def test_requests_spread_over_replicas_and_retry_past_a_dead_one(served_qwen2):
    engine = served_qwen2.engine
    dead = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient(
        [dead, engine.urls[0]],
        engine.client.model,
        gate=engine.gate,
        options=ClientOptions(max_retries=1, retry_backoff_s=0.05),
        token=engine.token,
    )
    try:
        out = client.generate(PROMPTS * 2, n=2, temperature=1.0, max_tokens=4, seed=0)
    finally:
        client.close()
    assert len(out) == 12 and sorted({c.prompt_index for c in out}) == list(range(6))


def test_no_reachable_server_raises_rollout_error_quickly():
    client = RolloutClient(
        [f"http://127.0.0.1:{free_port()}"],
        "m",
        options=ClientOptions(max_retries=2, retry_backoff_s=0.05, connect_timeout_s=5.0),
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutError, match="prompt 0 failed after 3 attempts"):
            client.generate([[1, 2, 3]], n=1, temperature=1.0, max_tokens=2)
    finally:
        client.close()
    assert time.monotonic() - t0 < 30
