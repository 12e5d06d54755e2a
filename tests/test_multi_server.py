"""Several owned vLLM servers behind one engine: every server synced, verified and version-checked each
push; requests placed by queue depth; a stalled server's requests moved elsewhere; a server killed mid-step
restarted and re-synced with no prompt lost. The vLLM tests share two real CPU servers (assets/tiny_arith).
"""

import asyncio
import dataclasses
from pathlib import Path

import pytest

from rljax.config import Config, ConfigError, validate
from rljax.rollout.client import _Queues, least_loaded, progress_count
from rljax.rollout.server import ServerOptions, server_command

ASSET = str(Path(__file__).resolve().parents[1] / "assets" / "tiny_arith")
TOL = 1e-4  # float32 vLLM CPU kernels vs transformers: ~5e-6 measured (tests/test_weight_sync.py)
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
