"""Async rollout client for vLLM's OpenAI-compatible `/v1/completions` (token ids in, token ids out).

Log-prob convention (the trainer must mean the same thing): **processed log-probs**. Servers run with
`--logprobs-mode processed_logprobs`, so `Completion.logprobs[j]` is `log_softmax(logits / T)` of the
sampled token, after top-k / top-p truncation when those are on (then renormalised over the kept
tokens); for greedy requests (T = 0) it is `log_softmax(logits)`. `rljax.trainer` divides logits by
the sampler's temperature; with the defaults top_p = 1 and top_k = 0 (off) the two agree exactly.

`generate` sends one request per prompt (`n` samples each; per-prompt seed `seed + i * n`, vLLM gives
sample j `seed + i * n + j`), each to the server with the fewest outstanding requests (queue depth,
counted over every concurrent `generate` call of this client), at most `max_in_flight` per server. A
failed request (connection error, HTTP error, a choice aborted by a pause, no progress) is retried on
another server up to `max_retries` times; then the whole call raises `RolloutError`. Nothing is dropped:
the call returns exactly `len(prompts) * n` completions or raises.

There is no total request timeout (a long generation is fine while it progresses): a watchdog reads each
busy server's vLLM token counters (`/metrics`) every second, and the requests of a server that has
processed no prompt or generated token for `no_progress_timeout_s` (or whose `/metrics` does not answer
that long) fail with `TimeoutError` and are retried elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import aiohttp

from rljax.config import DEFAULTS
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
    # A busy server with no new token for this long fails its requests (defaults: the config's, DEFAULTS).
    no_progress_timeout_s: float = DEFAULTS.rollout.vllm.no_progress_timeout_s
    max_retries: int = DEFAULTS.rollout.vllm.max_retries
    retry_backoff_s: float = 0.5
    max_in_flight: int = DEFAULTS.rollout.max_in_flight  # per server
    connect_timeout_s: float = 10.0
    # A server a request just failed on gets no new requests for this long while another one is up.
    failed_server_pause_s: float = 5.0


# vLLM's token counters (Prometheus): any change means the server is making progress.
_PROGRESS = re.compile(r"^vllm:(?:prompt|generation)_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def progress_count(metrics_text: str) -> float:
    """Prompt + generated tokens a vLLM server has processed (from its `/metrics` text)."""
    return sum(float(v) for v in _PROGRESS.findall(metrics_text))


def least_loaded(outstanding: dict[str, int], cap: int, avoid: frozenset[str] = frozenset()) -> str | None:
    """The server with the fewest outstanding requests below `cap` (first listed wins ties), preferring
    servers not in `avoid` (those a request already failed on); None when every candidate is full."""
    candidates = [u for u in outstanding if u not in avoid] or list(outstanding)
    free = [u for u in candidates if outstanding[u] < cap]
    return min(free, key=lambda u: outstanding[u]) if free else None


async def _read_progress(session: aiohttp.ClientSession, url: str) -> float | None:
    """`progress_count` of a server, None when its `/metrics` does not answer (in the session's timeout)."""
    try:
        async with session.get(url + "/metrics") as r:
            return progress_count(await r.text()) if r.status == 200 else None
    except (TimeoutError, aiohttp.ClientError):
        return None


class _Queues:
    """Outstanding requests per server (on the client's event loop) and each server's progress clock."""

    def __init__(self, urls: Sequence[str], cap: int):
        self.outstanding, self.cap = dict.fromkeys(urls, 0), cap
        self.last_progress = dict.fromkeys(urls, time.monotonic())
        self.counts: dict[str, float] = {}
        self.stalled = {u: asyncio.Event() for u in urls}
        self.failed_until = dict.fromkeys(urls, 0.0)
        self._free = asyncio.Condition()

    async def acquire(self, avoid: frozenset[str]) -> str:
        async with self._free:
            now = time.monotonic()
            avoid = avoid | {u for u, t in self.failed_until.items() if t > now}
            while (url := least_loaded(self.outstanding, self.cap, avoid)) is None:
                await self._free.wait()
            if self.outstanding[url] == 0:  # idle time is not a stall
                self._restart_clock(url)
            self.outstanding[url] += 1
            return url

    async def release(self, url: str) -> None:
        async with self._free:
            self.outstanding[url] -= 1
            self._free.notify_all()

    def observe(self, url: str, count: float | None, timeout_s: float) -> None:
        """Records a progress reading (None: unreadable); sets `stalled[url]` past the timeout."""
        if self.outstanding[url] == 0 or (count is not None and count != self.counts.get(url)):
            self._restart_clock(url)
        if count is not None:
            self.counts[url] = count
        if time.monotonic() - self.last_progress[url] > timeout_s:
            self.stalled[url].set()

    def _restart_clock(self, url: str) -> None:
        self.last_progress[url] = time.monotonic()
        if self.stalled[url].is_set():
            self.stalled[url] = asyncio.Event()


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
        policy: Callable[[], contextlib.AbstractContextManager[tuple[str, int]]] | None = None,
    ):
        """`policy()`: what a generate call samples with, held for the call: (the served model's name, the
        policy version every completion is tagged with). Default: `model` at the gate's version, the gate
        held shared; a LoRA run's is `AdapterPublisher.lease` (each version its own adapter name)."""
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.urls, self.model, self.options = list(urls), model, options
        self._headers = bearer_headers(token)  # the servers' bearer token (rljax.rollout.auth)
        self.gate = gate or PolicyGate()
        self.policy = policy or self._gate_policy
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="rljax-rollout")
        self._thread.start()
        self._metrics: dict[str, float] = {}
        self.sent: dict[str, int] = dict.fromkeys(self.urls, 0)  # requests sent per server, ever
        self._queues = asyncio.run_coroutine_threadsafe(self._start_watchdog(), self._loop).result()

    async def _start_watchdog(self) -> _Queues:
        queues = _Queues(self.urls, self.options.max_in_flight)
        self._watchdog = asyncio.ensure_future(self._watch(queues))
        return queues

    async def _watch(self, queues: _Queues) -> None:
        """Every `poll` s: reads the token counters of each server with outstanding requests."""
        timeout_s = self.options.no_progress_timeout_s
        poll = min(1.0, timeout_s / 4)
        http_timeout = aiohttp.ClientTimeout(total=max(poll, min(timeout_s, 5.0)))
        async with aiohttp.ClientSession(timeout=http_timeout, headers=self._headers) as session:
            while True:
                busy = [u for u, k in queues.outstanding.items() if k > 0]
                counts = await asyncio.gather(*(_read_progress(session, u) for u in busy))
                for url, count in zip(busy, counts, strict=True):
                    queues.observe(url, count, timeout_s)
                await asyncio.sleep(poll)

    @contextlib.contextmanager
    def _gate_policy(self) -> Iterator[tuple[str, int]]:
        with self.gate.shared() as version:
            yield self.model, version

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
        with self.policy() as (model, version):
            if self.gate.broken:
                raise RolloutError(f"servers are not servable: {self.gate.broken}")
            t0 = time.perf_counter()
            bodies = [
                request_body(
                    model,
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
        out = [c for group, _ in results for c in group]
        tokens = sum(len(c.token_ids) for c in out)
        placed = [url for _, url in results]
        self._metrics = {
            "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
            "rollout/policy_version": float(version),
            "rollout/seconds": seconds,
            "rollout/max_server_share": max(placed.count(u) for u in self.urls) / max(len(placed), 1),
        }
        return out

    def metrics(self) -> dict[str, float]:
        """Metrics of the last `generate` call."""
        return dict(self._metrics)

    async def _run_all(self, prompts, bodies, n, version) -> list[tuple[list[Completion], str]]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.options.connect_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers) as session:
            tasks = [
                asyncio.ensure_future(self._one(session, i, prompts[i], b, n, version))
                for i, b in enumerate(bodies)
            ]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _one(self, session, i, prompt, body, n, version) -> tuple[list[Completion], str]:
        """The completions of prompt i and the server that answered."""
        o, errors, tried = self.options, [], set()
        for attempt in range(o.max_retries + 1):
            url = await self._queues.acquire(frozenset(tried))
            tried.add(url)
            self.sent[url] += 1
            try:
                data = await self._post_watched(session, url, body)
                return parse_choices(data, prompt, n=n, version=version, prompt_index=i), url
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
                self._queues.failed_until[url] = time.monotonic() + o.failed_server_pause_s
            finally:
                await self._queues.release(url)
            if attempt < o.max_retries:
                await asyncio.sleep(o.retry_backoff_s * (attempt + 1))
        raise RolloutError(f"prompt {i} failed after {o.max_retries + 1} attempts: " + " | ".join(errors))

    async def _post_watched(self, session, url: str, body: dict) -> dict:
        """The JSON response, or TimeoutError once the watchdog marks `url` as making no progress."""
        post = asyncio.ensure_future(self._post(session, url, body))
        stalled = asyncio.ensure_future(self._queues.stalled[url].wait())
        try:
            await asyncio.wait({post, stalled}, return_when=asyncio.FIRST_COMPLETED)
            if not post.done():
                raise TimeoutError(f"no progress for {self.options.no_progress_timeout_s} s")
            return post.result()
        finally:
            for t in (post, stalled):
                t.cancel()
            await asyncio.gather(post, stalled, return_exceptions=True)

    @staticmethod
    async def _post(session, url: str, body: dict) -> dict:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}: {(await r.text())[:300]}")
            return await r.json()

    async def _stop_watchdog(self) -> None:
        self._watchdog.cancel()
        await asyncio.gather(self._watchdog, return_exceptions=True)

    def close(self) -> None:
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._stop_watchdog(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
