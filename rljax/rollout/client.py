"""Async rollout client for vLLM's OpenAI-compatible `/v1/completions` (token ids in, token ids out).

Log-prob convention (the trainer must mean the same thing): **processed log-probs**. Servers run with
`--logprobs-mode processed_logprobs`, so `Completion.logprobs[j]` is `log_softmax(logits / T)` of the
sampled token, after top-k / top-p truncation when those are on (then renormalised over the kept
tokens); for greedy requests (T = 0) it is `log_softmax(logits)`. `rljax.trainer` divides logits by
the sampler's temperature; with the defaults top_p = 1 and top_k = 0 (off) the two agree exactly.

`generate` sends one request per prompt (`n` samples each; per-prompt seed `seed + i * n`, vLLM gives
sample j `seed + i * n + j`), up to `max_in_flight` at once, round-robin over the replicas. A failed
request (connection error, HTTP error, timeout, a choice aborted by a pause) is retried on the next
replica up to `max_retries` times; then the whole call raises `RolloutError`. Nothing is dropped:
the call returns exactly `len(prompts) * n` completions or raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Sequence

import aiohttp

from rljax.rollout.auth import bearer_headers
from rljax.weight_sync.gate import PolicyGate


class RolloutError(RuntimeError):
    """A rollout request failed after its retries, or the servers are not in a servable state."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample: `token_ids i32[T]`, `logprobs f32[T]` (processed, per sampled token)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" or "length"
    policy_version: int
    prompt_index: int
    sample_index: int


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    request_timeout_s: float = 120.0
    max_retries: int = 2
    retry_backoff_s: float = 0.5
    max_in_flight: int = 64


def request_body(
    model: str,
    prompt: Sequence[int],
    *,
    n: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_tokens: int,
    stop_token_ids: Sequence[int],
    seed: int | None,
) -> dict:
    """The `/v1/completions` JSON for one prompt (top_k 0 means off, which vLLM spells -1)."""
    body = {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "n": int(n),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k) if top_k > 0 else -1,
        "max_tokens": int(max_tokens),
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if seed is not None:
        body["seed"] = int(seed)
    return body


def parse_choices(
    data: dict, prompt: Sequence[int], *, n: int, version: int, prompt_index: int
) -> list[Completion]:
    """Completions from one response; raises ValueError on an aborted or malformed choice."""
    choices = data.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(n)):
        raise ValueError(f"expected choices 0..{n - 1}, got {[c.get('index') for c in choices]}")
    out = []
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            raise ValueError(f"choice finished with {c.get('finish_reason')!r}")
        tokens, lps = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
        if tokens is None or lps is None or len(tokens) != len(lps) or any(x is None for x in lps):
            raise ValueError("choice lacks token ids or one log-prob per token")
        out.append(
            Completion(
                tuple(int(x) for x in prompt),
                tuple(int(x) for x in tokens),
                tuple(float(x) for x in lps),
                c["finish_reason"],
                version,
                prompt_index,
                c["index"],
            )
        )
    return out


class RolloutClient:
    """Sync facade over an asyncio loop in a daemon thread; safe to call from several threads."""

    def __init__(
        self,
        urls: Sequence[str],
        model: str,
        *,
        gate: PolicyGate | None = None,
        options: ClientOptions = ClientOptions(),
        token: str | None = None,
    ):
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.urls, self.model, self.options = list(urls), model, options
        self._headers = bearer_headers(token)  # the servers' bearer token (rljax.rollout.auth)
        self.gate = gate or PolicyGate()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="rljax-rollout")
        self._thread.start()
        self._metrics: dict[str, float] = {}

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> list[Completion]:
        """`len(prompts) * n` completions, ordered by (prompt_index, sample_index), all tagged with the
        served policy version; raises RolloutError if any request fails after its retries."""
        with self.gate.shared() as version:
            if self.gate.broken:
                raise RolloutError(f"servers are not servable: {self.gate.broken}")
            t0 = time.perf_counter()
            bodies = [
                request_body(
                    self.model,
                    p,
                    n=n,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    max_tokens=max_tokens,
                    stop_token_ids=stop_token_ids,
                    seed=None if seed is None else seed + i * n,
                )
                for i, p in enumerate(prompts)
            ]
            coro = self._run_all(prompts, bodies, n, version)
            results = asyncio.run_coroutine_threadsafe(coro, self._loop).result()
            seconds = time.perf_counter() - t0
        out = [c for group in results for c in group]
        tokens = sum(len(c.token_ids) for c in out)
        self._metrics = {
            "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
            "rollout/policy_version": float(version),
            "rollout/seconds": seconds,
        }
        return out

    def metrics(self) -> dict[str, float]:
        """Metrics of the last `generate` call."""
        return dict(self._metrics)

    async def _run_all(self, prompts, bodies, n, version) -> list[list[Completion]]:
        o = self.options
        sem = asyncio.Semaphore(o.max_in_flight)
        timeout = aiohttp.ClientTimeout(total=o.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers) as session:
            tasks = [
                asyncio.ensure_future(self._one(session, sem, i, prompts[i], b, n, version))
                for i, b in enumerate(bodies)
            ]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _one(self, session, sem, i, prompt, body, n, version) -> list[Completion]:
        o, errors = self.options, []
        for attempt in range(o.max_retries + 1):
            url = self.urls[(i + attempt) % len(self.urls)]
            try:
                async with sem, session.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise ValueError(f"HTTP {r.status}: {(await r.text())[:300]}")
                    data = await r.json()
                return parse_choices(data, prompt, n=n, version=version, prompt_index=i)
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
                if attempt < o.max_retries:
                    await asyncio.sleep(o.retry_backoff_s * (attempt + 1))
        raise RolloutError(f"prompt {i} failed after {o.max_retries + 1} attempts: " + " | ".join(errors))

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
