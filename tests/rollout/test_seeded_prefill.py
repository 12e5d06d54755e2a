"""Seeded requests whose prompts exceed the engine's batched-token budget (issue 20's vLLM CPU crash).

vLLM samples a token for a partially prefilled request and discards it, rewinding the request's seeded
generator by an offset that torch's CPU generator does not have: the CPU engine dies with "CPU Generator
does not use offset". rljax's owned CPU servers run with chunked prefill off (`server.prefill_args`), so no
prefill is partial. The real-vLLM tests show the crash on vLLM's defaults first (and that the run stops
within one restart, quoting the log's root-cause line), then the same requests passing on rljax's command.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from vllm_server import TEST_SERVER_OPTIONS

from rljax.rollout import EngineCrashError, RolloutEngine, VLLMServer
from rljax.rollout.crashes import crash_cause, prefill_args
from rljax.rollout.server import ServerOptions, server_command

# What vLLM 0.32's CPU engine logged for the crash (worker, engine core and API server), abridged.
_W = "(Worker pid=3327) ERROR 12-06 06:27:19 [multiproc_executor.py:1063]"
CRASH_LOG = f"""\
INFO 12-06 06:27:10 [core.py:100] engine started
{_W} Traceback (most recent call last):
{_W}   File "gpu_model_runner.py", in _bookkeeping_sync
{_W}     gen.set_offset(gen.get_offset() - 4)
{_W} RuntimeError: CPU Generator does not use offset
(EngineCore pid=3314) ERROR 12-06 06:27:19 [core.py:1512] RuntimeError: Worker failed with error 'CPU \
Generator does not use offset', please check the stack trace above for the root cause
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above).
"""


def test_crash_cause_is_the_first_exception_after_the_first_traceback():
    assert crash_cause(CRASH_LOG) == "RuntimeError: CPU Generator does not use offset"
    assert crash_cause("INFO ok\nValueError: a logged value error without a traceback\n") is None
    assert crash_cause("Traceback (most recent call last):\n  File x\nKeyError: 'w'\n") == "KeyError: 'w'"


def test_cpu_build_servers_keep_every_prefill_whole():
    # vLLM's CPU server budget (2048 tokens) where it holds the longest prompt, else max_model_len
    whole = ["--no-enable-chunked-prefill", "--max-num-batched-tokens"]
    assert prefill_args(512, cpu_build=True) == [*whole, "2048"]
    assert prefill_args(4096, cpu_build=True) == [*whole, "4096"]
    assert prefill_args(512, cpu_build=False) == []
    cpu = server_command("m", "127.0.0.1", 1, ServerOptions(cpu_build=True, max_model_len=384))
    assert cpu[cpu.index("--no-enable-chunked-prefill") :][:3] == [*whole, "2048"]
    gpu = server_command("m", "127.0.0.1", 1, ServerOptions(cpu_build=False))
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu


class _CrashedServer:
    """A dead owned server whose log holds `cause`; counts its restarts."""

    def __init__(self, cause):
        self.cause, self.restarts, self.url, self.log_path = (
            cause,
            0,
            "http://127.0.0.1:1",
            "/w/vllm_server.log",
        )

    options = ServerOptions()
    healthy = lambda self: False

    def crash_cause(self):
        return self.cause

    def stop(self):
        pass

    def spawn(self):
        self.restarts += 1

    def wait_healthy(self, timeout_s):
        pass


def _engine(server):
    parts = SimpleNamespace(reset=lambda: None, gate=SimpleNamespace(broken=None))
    return RolloutEngine(SimpleNamespace(gate=parts.gate), parts, servers=[server], max_restarts=3)


def test_the_same_crash_after_a_restart_stops_the_engine_naming_the_log():
    server = _CrashedServer("RuntimeError: CPU Generator does not use offset")
    engine = _engine(server)
    engine.restart_unhealthy()  # the first crash: restarted
    with pytest.raises(
        EngineCrashError, match=r"same error.*CPU Generator does not use offset.*vllm_server\.log"
    ):
        engine.restart_unhealthy()
    assert server.restarts == 1


def test_a_different_crash_or_a_hang_is_restarted_again():
    server = _CrashedServer("RuntimeError: one")
    engine = _engine(server)
    engine.restart_unhealthy()
    server.cause = "RuntimeError: another"
    engine.restart_unhealthy()
    server.cause = None  # no traceback in the log (killed, hung): transient
    engine.restart_unhealthy()
    engine.restart_unhealthy()
    assert server.restarts == 4


def _long_seeded_prompts(vocab: int) -> list[list[int]]:
    """16 prompts of 150-450 tokens: 4,800 prompt tokens in one batch, over vLLM's CPU server budget (2,048
    tokens, which rljax's CPU servers keep) and far over the 256 of the crash test."""
    rng = np.random.default_rng(0)
    return [rng.integers(5, vocab, size=150 + 20 * i).tolist() for i in range(16)]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_defaults_crash_and_the_run_stops_within_one_restart(tmp_path):
    from vllm_server import ARITH_MODEL

    # vLLM's own behaviour: chunked prefill on (cpu_build=False: no rljax flags) and a small budget.
    options = ServerOptions(
        cpu_build=False,
        extra_args=("--max-num-batched-tokens", "256"),
        gpu_memory_utilization=TEST_SERVER_OPTIONS.gpu_memory_utilization,
        max_model_len=TEST_SERVER_OPTIONS.max_model_len,
    )
    server = VLLMServer(ARITH_MODEL, tmp_path, options=options).start()
    engine = RolloutEngine.connect([server.url], ARITH_MODEL, servers=[server], max_restarts=3)
    try:
        with pytest.raises(EngineCrashError, match="CPU Generator does not use offset") as err:
            engine.generate(_long_seeded_prompts(500), n=2, temperature=1.0, max_tokens=4, seed=7)
        assert str(server.log_path) in str(err.value)
        assert server.log_path.read_text().count("=== rljax: starting") == 2  # one restart, then stopped
    finally:
        engine.close()


@pytest.mark.vllm
def test_seeded_prompts_over_the_budget_generate_on_rljax_servers(served_qwen2):
    engine = served_qwen2.engine
    prompts = _long_seeded_prompts(500)
    a = engine.generate(prompts, n=2, temperature=1.0, max_tokens=4, seed=7)
    b = engine.generate(prompts, n=2, temperature=1.0, max_tokens=4, seed=7)
    assert len(a) == 32 and all(1 <= len(c.token_ids) <= 4 for c in a)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]  # seeded: the same samples again
    for c in a[:4]:  # and the right log-probs for the whole (never partial) prompt
        np.testing.assert_allclose(
            c.logprobs, served_qwen2.ref.logprobs(list(c.prompt_ids), list(c.token_ids)), atol=1e-4
        )


def test_chunked_prefill_in_extra_args_is_a_config_error_on_the_cpu_build():
    import dataclasses

    from rljax import config as C

    cfg = C.Config()
    vllm = dataclasses.replace(cfg.rollout.vllm, extra_args=("--enable-chunked-prefill",))
    bad = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm=vllm))
    assert C.vllm_is_cpu_build()  # the suite runs on the CPU build (setup_env.sh cpu)
    with pytest.raises(C.ConfigError, match=r"rollout\.vllm\.extra_args.*chunked-prefill"):
        C.validate(bad)
