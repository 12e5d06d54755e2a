"""The canary: after each sync, the server's log-probs of fixed tokens must match the trainer's.

Two probes per server of the fixed tokens `prompt + completion` (`CanarySpec`), compared with
`trainer_logprobs(prompt_ids, completion_ids) -> f32[C]` (the trainer's log-probs of each completion token
at temperature 1, no truncation):

1. first token (prefix cache): one greedy token after the prompt, with the log-prob of `completion[0]`
   there (`logprob_token_ids`; greedy requests report `log_softmax` of the unscaled logits, whatever
   token is sampled). This request reuses the prefix cache, whose blocks for this prompt were filled by
   the previous canary under the previous weights: a cache not cleared by the sync shows here (the
   token attends over every cached block);
2. prompt log-probs of `prompt + completion` (`prompt_logprobs=0`, one forward over the whole sequence,
   computed without the prefix cache), sent after probe 1 so it cannot refill the cache probe 1 reads.

The trainer scores `prompt + completion` once, which covers both probes (its first value is probe 1's).
The question never depends on the server's answer, so the trainer's forward can start before the push
(`rljax.loop.snapshots.CanaryAnswers`). The prompt spans 2 full KV blocks of the servers' block size (read
from their `/metrics`, `server_block_size`) so probe 1 really hits the cache; a short prompt keeps the
trainer's forward cheap (vLLM's CPU default of 128 costs a 512-token bucket). Failure raises
`CanaryError` with the max / mean absolute differences.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

TrainerLogprobs = Callable[[list[int], list[int]], np.ndarray]


class CanaryError(RuntimeError):
    """Server and trainer log-probs disagree beyond the tolerance (or the server answered badly)."""


@dataclasses.dataclass(frozen=True)
class CanarySpec:
    """Fixed canary tokens: `prompt_ids i32[P]`, `completion_ids i32[C]` (the servers are asked for its
    first token after the prompt, then for the prompt log-probs of all of it)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]


DEFAULT_BLOCK_SIZE = 128  # vLLM's largest default KV block (its CPU build); used when a server's is unknown


def canary_prompt_len(block_size: int) -> int:
    """Prompt tokens that fill 2 full KV blocks of `block_size` plus a partial one: vLLM caches only full
    blocks and always recomputes the last prompt token, so the first-token probe then reuses 2 cached
    blocks."""
    return 2 * block_size + 8


def make_canary(
    vocab_size: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    prompt_len: int | None = None,
    completion_len: int = 24,
    seed: int = 1234,
) -> CanarySpec:
    """Deterministic pseudo-random canary tokens in [1, vocab_size); the prompt is sized for the servers'
    KV `block_size` (`canary_prompt_len`) unless `prompt_len` is given."""
    if prompt_len is None:
        prompt_len = canary_prompt_len(block_size)
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab_size, size=prompt_len + completion_len)
    return CanarySpec(tuple(int(t) for t in ids[:prompt_len]), tuple(int(t) for t in ids[prompt_len:]))


_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.M)


def server_block_size(url: str, timeout_s: float = 10.0, headers: dict | None = None) -> int | None:
    """The KV-cache block size a vLLM server runs with (its `vllm:cache_config_info` Prometheus gauge),
    or None if `/metrics` does not say (other servers, metrics off)."""
    try:
        r = requests.get(url + "/metrics", headers=headers, timeout=timeout_s)
        r.raise_for_status()
    except requests.RequestException:
        return None
    m = _BLOCK_SIZE.search(r.text)
    return int(m.group(1)) if m else None


def _post(url: str, body: dict, timeout_s: float, headers: dict | None) -> dict:
    try:
        r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout_s)
    except requests.RequestException as e:
        raise CanaryError(f"canary request to {url} failed: {e}") from e
    if r.status_code != 200:
        raise CanaryError(f"canary request to {url} failed: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()["choices"][0]


def server_prompt_logprobs(
    url: str,
    model: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    timeout_s: float = 30.0,
    headers: dict | None = None,
) -> np.ndarray:
    """The server's log-prob of each completion token after `prompt_ids`: f32[len(completion_ids)]."""
    body = {
        "model": model,
        "prompt": list(prompt_ids) + list(completion_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    entries = _post(url, body, timeout_s, headers)["prompt_logprobs"]
    tail = entries[len(prompt_ids) :]
    out = []
    for tok, entry in zip(completion_ids, tail, strict=True):
        if not entry or str(tok) not in entry:
            raise CanaryError(f"server returned no prompt log-prob for token {tok}")
        out.append(entry[str(tok)]["logprob"])
    return np.asarray(out, np.float32)


def server_first_token(
    url: str,
    model: str,
    prompt_ids: list[int],
    token: int,
    timeout_s: float = 30.0,
    headers: dict | None = None,
) -> np.ndarray:
    """f32[1]: the server's log-prob of `token` as the first token after `prompt_ids` (one greedy step,
    `logprob_token_ids=[token]`; whatever the server samples)."""
    body = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": 1,
        "logprob_token_ids": [int(token)],
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    tops = _post(url, body, timeout_s, headers)["logprobs"]["top_logprobs"]
    key = f"token_id:{int(token)}"
    if len(tops) != 1 or not tops[0] or key not in tops[0]:
        raise CanaryError(f"canary first-token probe on {url}: no log-prob for token {token} in {tops}")
    return np.asarray([tops[0][key]], np.float32)


def check_canary(
    url: str,
    model: str,
    spec: CanarySpec,
    trainer_logprobs: TrainerLogprobs,
    *,
    tolerance: float,
    timeout_s: float = 30.0,
    headers: dict | None = None,
) -> tuple[float, float]:
    """Runs both probes on one server (`headers`: its bearer token); returns (max, mean) abs diff or raises
    CanaryError."""
    prompt, completion = [int(t) for t in spec.prompt_ids], [int(t) for t in spec.completion_ids]
    first_lp = server_first_token(url, model, prompt, completion[0], timeout_s, headers)
    with ThreadPoolExecutor(1, thread_name_prefix="rljax-canary") as pool:
        fixed = pool.submit(server_prompt_logprobs, url, model, prompt, completion, timeout_s, headers)
        trainer_lp = np.asarray(trainer_logprobs(prompt, completion), np.float32)
        fixed_lp = fixed.result()
    server, trainer = [first_lp, fixed_lp], [trainer_lp[:1], trainer_lp]
    diffs = []
    for probe, (s, t) in zip(
        ("first token (prefix cache)", "prompt_logprobs"), zip(server, trainer, strict=True), strict=True
    ):
        if s.shape != t.shape:
            raise CanaryError(f"canary {probe}: trainer gave shape {t.shape}, server {s.shape}")
        d = np.abs(s.astype(np.float64) - t.astype(np.float64))
        if not np.all(np.isfinite(d)) or d.max() > tolerance:
            raise CanaryError(
                f"canary {probe} on {url}: server log-probs differ from the trainer's by max {d.max():.3g}, "
                f"mean {d.mean():.3g} (tolerance {tolerance:g}): the server is not serving the pushed weights"
            )
        diffs.append(d)
    d = np.concatenate(diffs)
    return float(d.max()), float(d.mean())
