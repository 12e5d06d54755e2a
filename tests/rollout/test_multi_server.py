"""Several owned vLLM servers behind one engine: every server synced, verified and version-checked each
push; requests placed by queue depth; a stalled server's requests moved elsewhere; a server killed mid-step
restarted and re-synced with no prompt lost. The vLLM tests share two real CPU servers (assets/tiny_arith).
"""

import asyncio
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from faults import kill_when_running
from vllm_server import TEST_SERVER_OPTIONS, TorchReference, perturbed

from rljax.config import Config, ConfigError, validate
from rljax.rollout import ClientOptions, HostWeights, RolloutClient, RolloutEngine
from rljax.rollout.auth import bearer_headers
from rljax.rollout.client import _Queues, least_loaded, progress_count
from rljax.rollout.server import ServerOptions, server_command
from rljax.weight_sync.canary import server_prompt_logprobs

ASSET = str(Path(__file__).resolve().parents[2] / "assets" / "tiny_arith")
TOL = 1e-4  # float32 vLLM CPU kernels vs transformers: ~5e-6 measured (tests/weight_sync/test_weight_sync.py)
PROBE = ([3, 14, 15, 9, 26, 5], [35, 8, 9, 7, 9, 3, 2, 38])


# --- placement and progress, no server ---------------------------------------------------------------


def test_least_loaded_prefers_fewest_outstanding_then_untried_then_waits():
    assert least_loaded({"a": 2, "b": 1, "c": 1}, cap=4) == "b"  # fewest; first listed wins the tie
    assert least_loaded({"a": 0, "b": 3}, cap=4, avoid=frozenset({"a"})) == "b"  # a request failed on a
    assert least_loaded({"a": 0, "b": 4}, cap=4, avoid=frozenset({"a"})) is None  # wait for b's slot
    assert least_loaded({"a": 1}, cap=4, avoid=frozenset({"a"})) == "a"  # the only server: retry there
    assert least_loaded({"a": 4, "b": 4}, cap=4) is None


def test_progress_count_reads_vllm_token_counters():
    text = (
        "# HELP vllm:prompt_tokens_total x\n"
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 3.5e+02\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    )
    assert progress_count(text) == 470.0


def test_queues_mark_a_busy_server_stalled_only_without_progress():
    async def run():
        q = _Queues(["a"], cap=2)
        assert await q.acquire(frozenset()) == "a"
        q.last_progress["a"] -= 10.0  # 10 s since the last reading changed
        q.observe("a", 5.0, timeout_s=5.0)  # a new count: progress, the clock restarts
        assert not q.stalled["a"].is_set()
        q.last_progress["a"] -= 10.0
        q.observe("a", 5.0, timeout_s=5.0)  # same count for 10 s > 5 s
        assert q.stalled["a"].is_set()
        await q.release("a")
        q.observe("a", None, timeout_s=5.0)  # idle: not stalled, the event is fresh
        assert not q.stalled["a"].is_set()

    asyncio.run(run())


def _with_vllm(**fields) -> Config:
    base = Config()
    return dataclasses.replace(
        base, rollout=dataclasses.replace(base.rollout, vllm=dataclasses.replace(base.rollout.vllm, **fields))
    )


@pytest.mark.parametrize(
    "fields,key",
    [
        ({"num_servers": 0}, "rollout.vllm.num_servers"),
        ({"tensor_parallel_size": 0}, "rollout.vllm.tensor_parallel_size"),
        ({"data_parallel_size": -1}, "rollout.vllm.data_parallel_size"),
        ({"num_servers": 2, "urls": ("http://127.0.0.1:1",)}, "rollout.vllm.num_servers"),
        ({"no_progress_timeout_s": 0.0}, "rollout.vllm.no_progress_timeout_s"),
    ],
)
def test_config_validates_server_counts(fields, key):
    with pytest.raises(ConfigError, match=key):
        validate(_with_vllm(**fields))
    cfg = Config()
    with pytest.raises(ConfigError, match="rollout.max_in_flight"):
        validate(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_in_flight=0)))
    validate(_with_vllm(num_servers=2, tensor_parallel_size=2, data_parallel_size=2))  # valid (GPU to run)


def test_server_command_passes_tensor_and_data_parallel_sizes():
    cmd = server_command("/m", "127.0.0.1", 1, ServerOptions(tensor_parallel_size=2, data_parallel_size=4))
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--data-parallel-size") + 1] == "4"


# --- two real servers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two owned tiny_arith servers behind one engine (started at once), with a transformers reference as
    the canary's trainer side; the engine restarts a dead server and re-pushes (max_restarts=2)."""
    ref = TorchReference(ASSET)
    engine = RolloutEngine.launch(
        ASSET,
        tmp_path_factory.mktemp("multi"),
        replicas=2,
        server_options=TEST_SERVER_OPTIONS,
        max_restarts=2,
    )
    try:
        yield engine, ref
    finally:
        engine.close()


def _push(engine, ref, version: int, seed: int) -> dict:
    state = perturbed(ref.state(), seed=seed)
    ref.load(state)
    return engine.push_weights(HostWeights(ref.logprobs).snapshot(state.items()), version)


def _assert_every_server_serves(engine, ref, version: int) -> None:
    want = ref.logprobs(*PROBE)
    for url in engine.urls:
        assert engine.syncer.server_version(url) == str(version)
        got = server_prompt_logprobs(url, engine.client.model, *PROBE, headers=bearer_headers(engine.token))
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def _share(engine, before: dict) -> dict:
    return {u: engine.client.sent[u] - before[u] for u in engine.urls}


@pytest.mark.vllm
def test_both_servers_get_every_version_and_requests_split_by_queue_depth(two_servers):
    engine, ref = two_servers
    assert len({s.port for s in engine.servers}) == 2
    for version in (1, 2):
        metrics = _push(engine, ref, version, seed=version)
        assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= TOL
        _assert_every_server_serves(engine, ref, version)
    before = dict(engine.client.sent)
    out = engine.generate(
        [[3, 14, 15, 9, 26, 5 + i % 7] for i in range(64)], n=2, temperature=1.0, max_tokens=8
    )
    assert len(out) == 128 and {c.policy_version for c in out} == {2}
    sent = _share(engine, before)
    print(f"requests per server: {sent}")
    assert sum(sent.values()) == 64 and max(sent.values()) <= 0.6 * 64
    assert engine.metrics()["rollout/max_server_share"] <= 0.6


@pytest.mark.vllm
def test_a_stalled_servers_requests_move_to_the_other_without_a_total_timeout(two_servers):
    engine, _ = two_servers
    stalled = engine.servers[1]
    options = ClientOptions(no_progress_timeout_s=3.0, retry_backoff_s=0.05)
    client = RolloutClient(
        engine.urls, engine.client.model, gate=engine.gate, options=options, token=engine.token
    )
    os.killpg(stalled.pid, signal.SIGSTOP)  # alive, accepts connections, answers nothing
    try:
        out = client.generate([[3, 14, 15, 9, 26, i] for i in range(8)], n=2, temperature=1.0, max_tokens=8)
    finally:
        os.killpg(stalled.pid, signal.SIGCONT)
        client.close()
    assert sorted({c.prompt_index for c in out}) == list(range(8)) and len(out) == 16
    assert client.sent[stalled.url] >= 1  # some went there first, timed out for lack of progress, moved
    assert client.sent[engine.urls[0]] == 8


@pytest.mark.vllm
def test_killing_one_server_mid_step_is_recovered_with_no_prompt_lost(two_servers):
    engine, ref = two_servers
    version = engine.version
    victim, done = engine.servers[1], threading.Event()
    killer = kill_when_running([victim], done)
    prompts = [[3, 14, 15, 9, 26, 5 + i % 7] for i in range(64)]
    try:
        out = engine.generate(prompts, n=2, temperature=1.0, max_tokens=16)
    finally:
        done.set()
        killer["thread"].join()
    assert killer["killed"], "the victim finished before it could be killed"
    assert len(out) == 128 and sorted({c.prompt_index for c in out}) == list(range(64))  # no prompt lost
    t0 = time.perf_counter()
    metrics = _push(engine, ref, version + 1, seed=7)  # fails on the dead server: restart, re-push
    print(f"recovery metrics: {metrics}, step push incl. recovery {time.perf_counter() - t0:.1f} s")
    assert metrics["recovery/restarts"] == 1.0 and victim.healthy()
    assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= TOL
    _assert_every_server_serves(engine, ref, version + 1)
    before = dict(engine.client.sent)
    again = engine.generate(prompts, n=2, temperature=1.0, max_tokens=8)
    assert len(again) == 128 and min(_share(engine, before).values()) > 0  # the restarted one serves again


class _ScriptedServer:
    """A stand-in HTTP server (control flow only): `/v1/completions` answers after `delay_s`; its `/metrics`
    token counter moves while `progressing` (a long generation) or stays put (a hung engine)."""

    def __init__(self, delay_s: float, progressing: bool):
        from aiohttp import web

        self.delay_s, self.progressing, self.tokens = delay_s, progressing, 0
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/metrics", self._metrics)
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    async def _complete(self, request):
        from aiohttp import web

        body = await request.json()
        await asyncio.sleep(self.delay_s)
        choice = {
            "index": 0,
            "finish_reason": "length",
            "token_ids": [7],
            "logprobs": {"token_logprobs": [-1.0]},
        }
        return web.json_response({"choices": [choice] * body["n"]})

    async def _metrics(self, request):
        from aiohttp import web

        self.tokens += 1 if self.progressing else 0
        return web.Response(text=f'vllm:generation_tokens_total{{engine="0"}} {self.tokens}.0\n')

    async def _shutdown(self):
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:  # handlers still waiting (a hung engine's) end here, not in a later test's GC
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._runner.cleanup()

    def close(self):
        """Shuts the server down on its loop (cancelling a hung handler), then stops and closes the loop:
        handler tasks left pending would log "Task was destroyed" into whichever later test collects them."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


def test_a_progressing_request_outlives_the_timeout_and_a_hung_one_moves():
    slow = _ScriptedServer(delay_s=3.0, progressing=True)  # 3 s > the 1 s no-progress timeout
    hung = _ScriptedServer(delay_s=60.0, progressing=False)
    options = ClientOptions(no_progress_timeout_s=1.0, retry_backoff_s=0.01)
    client = RolloutClient([hung.url, slow.url], "m", options=options)
    try:
        out = client.generate([[1], [2], [3], [4]], n=1, temperature=1.0, max_tokens=1)
    finally:
        client.close()
        slow.close()
        hung.close()
    assert sorted(c.prompt_index for c in out) == [0, 1, 2, 3]
    assert client.sent == {
        hung.url: 2,
        slow.url: 4,
    }  # 2 placed on the hung one, moved; none of slow's retried
