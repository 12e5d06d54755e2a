"""Session-scoped vLLM servers for the rollout and weight-sync tests (load with `pytest_plugins`).

One server per tiny model family for the whole test run (vLLM start-up costs ~25-60 s on 2 cores), each
wrapped in a `Served`: the `RolloutEngine` plus a transformers float32 reference holding the weights the
server currently serves. Tests that push weights go through `Served.push`, so the two never drift; a
test that kills the server leaves it to `served_*` to restart it for the next test.

`arith_server`: one server of the default job's model (assets/tiny_arith) for the end-to-end tests that run
`python -m rljax.main` against a server they do not own (`rollout.vllm.urls` + `rollout.vllm.token_file`:
every run pushes its own weights first, so runs do not see each other's). It starts with the first test
that asks for it and stops after the last one (`pytest_runtest_teardown`), not at the end of the session.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from rljax.rollout import RolloutEngine, ServerOptions, StateDictWeights
from rljax.weight_sync import SyncOptions
from rljax.weight_sync.canary import server_prompt_logprobs

# Small on purpose: memory is shared with other jobs (PLATFORM.md: VLLM_CPU_KVCACHE_SPACE, utilization).
TEST_SERVER_OPTIONS = ServerOptions(
    gpu_memory_utilization=0.08, kvcache_space_gib=1, max_model_len=512, startup_timeout_s=300.0
)


class TorchReference:
    """transformers (torch, float32) on the weights the server should be serving."""

    def __init__(self, path: str):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tied = bool(self.model.config.tie_word_embeddings)

    def state(self) -> dict[str, np.ndarray]:
        """The HF state as numpy, without the tied lm_head (the checkpoint does not store it)."""
        sd = self.model.state_dict()
        return {
            k: v.detach().numpy().copy() for k, v in sd.items() if not (self.tied and k == "lm_head.weight")
        }

    def load(self, state: dict[str, np.ndarray]) -> None:
        self.model.load_state_dict(
            {k: self.torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=False
        )
        if self.tied:
            self.model.lm_head.weight = self.model.model.embed_tokens.weight

    def logits(self, ids: list[int]) -> np.ndarray:
        """f64[len(ids), V] next-token logits."""
        with self.torch.no_grad():
            return self.model(self.torch.tensor([list(ids)])).logits[0].double().numpy()

    def logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> np.ndarray:
        """f32[C]: log_softmax(logits / T) of each completion token (the canary's `trainer_logprobs`)."""
        if not completion_ids:
            return np.zeros(0, np.float32)
        z = self.logits(list(prompt_ids) + list(completion_ids))[len(prompt_ids) - 1 : -1] / temperature
        lp = z - z.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        return lp[np.arange(len(completion_ids)), completion_ids].astype(np.float32)


def perturbed(state: dict[str, np.ndarray], seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    """`state` plus Gaussian noise (float32): new, non-trivial weights for one update."""
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in state.items()}


@dataclasses.dataclass
class Served:
    engine: RolloutEngine
    ref: TorchReference
    path: str

    @property
    def server(self):
        return self.engine.servers[0]

    def push(self, state: dict[str, np.ndarray], version: int, **sync_kwargs) -> dict:
        """Pushes `state` as `version` with the reference as the canary's trainer side."""
        self.ref.load(state)
        syncer = self.engine.syncer
        if sync_kwargs:
            syncer.options = dataclasses.replace(syncer.options, **sync_kwargs)
        try:
            return self.engine.push_weights(state.items(), version)
        finally:
            syncer.options = SyncOptions()

    def ensure_servable(self) -> None:
        """Restarts a killed server and re-pushes the reference weights after a failed sync."""
        if not self.server.healthy() or self.engine.gate.broken:
            self.engine.restart_unhealthy()
            self.engine.push_weights(self.ref.state().items(), self.engine.version)


_FAMILIES = {"qwen2": {}, "llama": {"tie_word_embeddings": False}}  # qwen2 tied: vLLM's stale lm_head bug


@pytest.fixture(scope="session")
def _spawned_servers(request, tmp_path_factory):
    """Spawns, at once, a server for every family the collected tests use (start-ups overlap)."""
    from rljax.models.tiny import build_tiny_checkpoint
    from rljax.rollout import VLLMServer

    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    spawned = {}
    for family, overrides in _FAMILIES.items():
        if f"served_{family}" in used:
            root = tmp_path_factory.mktemp(f"vllm_{family}")
            path = str(build_tiny_checkpoint(root / "ckpt", family, **overrides))
            server = VLLMServer(path, root / "workdir", options=TEST_SERVER_OPTIONS).spawn()
            spawned[family] = (server, path)
    yield spawned
    for server, _ in spawned.values():
        server.stop()


def _served(spawned: dict, family: str) -> Served:
    server, path = spawned[family]
    server.wait_healthy(TEST_SERVER_OPTIONS.startup_timeout_s)
    ref = TorchReference(path)
    engine = RolloutEngine.connect(
        [server.url], path, servers=[server], weights=StateDictWeights(ref.logprobs)
    )
    return Served(engine, ref, path)


@pytest.fixture(scope="session")
def _qwen2_session(_spawned_servers):
    served = _served(_spawned_servers, "qwen2")
    yield served
    served.engine.close()


@pytest.fixture(scope="session")
def _llama_session(_spawned_servers):
    served = _served(_spawned_servers, "llama")
    yield served
    served.engine.close()


@pytest.fixture
def served_qwen2(_qwen2_session) -> Served:
    """The shared tiny-Qwen2 (tied) server, alive and serving `ref`'s weights."""
    _qwen2_session.ensure_servable()
    return _qwen2_session


@pytest.fixture
def served_llama(_llama_session) -> Served:
    """The shared tiny-Llama (untied) server, alive and serving `ref`'s weights."""
    _llama_session.ensure_servable()
    return _llama_session


ARITH_MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "assets" / "tiny_arith")


@dataclasses.dataclass(frozen=True)
class ArithServer:
    url: str
    token_file: str  # the server's bearer token (rollout.vllm.token_file)
    model: str = ARITH_MODEL

    def main_args(self) -> list[str]:
        """The `rljax.main` overrides that point a run at this server."""
        return [
            f"--config.model.path={self.model}",
            f"--config.rollout.vllm.urls=('{self.url}',)",
            f"--config.rollout.vllm.token_file={self.token_file}",
        ]


_ARITH: dict = {}  # the running arith server, for the early stop below


@pytest.fixture(scope="session")
def arith_server(tmp_path_factory):
    """The test run's tiny_arith server (TEST_SERVER_OPTIONS), shared by the end-to-end tests."""
    from rljax.rollout import VLLMServer

    server = VLLMServer(ARITH_MODEL, tmp_path_factory.mktemp("vllm_arith"), options=TEST_SERVER_OPTIONS)
    _ARITH["server"] = server.spawn()
    try:
        server.wait_healthy(TEST_SERVER_OPTIONS.startup_timeout_s)
        yield ArithServer(server.url, str(server.token_file))
    finally:
        server.stop()
        _ARITH.clear()


def pytest_runtest_teardown(item, nextitem):
    """Stops the arith server after the last collected test that uses it (its memory goes back early)."""
    if "server" not in _ARITH or "arith_server" not in getattr(item, "fixturenames", ()):
        return
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    if not any("arith_server" in getattr(i, "fixturenames", ()) for i in later):
        _ARITH["server"].stop()


# vLLM's CPU kernels and transformers accumulate float32 in different orders: ~5e-6 measured.
TOL = 1e-4
PROBE_PROMPT = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84]
PROBE_COMPLETION = [62, 64, 33, 83, 27, 95, 2, 88, 41, 97, 16, 93, 99, 37, 51, 5]


def assert_serves_reference(served, version: int) -> None:
    """Server log-probs of a probe (not the canary's tokens) match the reference; versions agree."""
    engine = served.engine
    got = server_prompt_logprobs(
        engine.urls[0], engine.client.model, PROBE_PROMPT, PROBE_COMPLETION, headers=engine.syncer.headers
    )
    want = served.ref.logprobs(PROBE_PROMPT, PROBE_COMPLETION)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert engine.syncer.server_version(engine.urls[0]) == str(version)
    assert engine.version == version
    (c,) = engine.generate([PROBE_PROMPT], n=1, temperature=0.0, max_tokens=4, seed=0)
    assert c.policy_version == version
