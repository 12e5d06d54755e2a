"""Shared vLLM servers for the rollout, weight-sync and end-to-end tests (load with `pytest_plugins`).

Each is a `shared.Shared` resource: started by the first test that needs it, stopped after the last test of
its group (`parallel.py` runs a group in a row on one worker; a vLLM start-up costs ~25-60 s on 2 cores).

`vllm_families`: one server per tiny model family (Qwen2 tied, Llama untied), each wrapped in a `Served`:
the `RolloutEngine` plus a transformers float32 reference holding the weights the server currently serves.
Tests that push weights go through `Served.push`, so the two never drift; a test that kills the server
leaves it to `served_*` to restart it for the next test.

`arith_server`: a server of the default job's model (assets/tiny_arith) for the end-to-end tests that run
`python -m rljax.main` against a server they do not own (`rollout.vllm.urls` + `rollout.vllm.token_file`:
every run pushes its own weights first, so runs do not see each other's). One per xdist worker that runs
such tests (`per_worker`): their groups are handed out first, so each worker starts it once.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np
import pytest
from shared import Shared

from rljax.rollout import HostWeights, RolloutEngine, ServerOptions
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

    @property
    def weights(self) -> HostWeights:
        """Host tensors with the reference as the canary's trainer side: `weights.snapshot(items)`."""
        return HostWeights(self.ref.logprobs)

    def push(self, state: dict[str, np.ndarray], version: int, **sync_kwargs) -> dict:
        """Pushes `state` as `version` with the reference as the canary's trainer side."""
        self.ref.load(state)
        syncer = self.engine.syncer
        if sync_kwargs:
            syncer.options = dataclasses.replace(syncer.options, **sync_kwargs)
        try:
            return self.engine.push_weights(self.weights.snapshot(state.items()), version)
        finally:
            syncer.options = SyncOptions()

    def ensure_servable(self) -> None:
        """Restarts a killed server and re-pushes the reference weights after a failed sync."""
        if not self.server.healthy() or self.engine.gate.broken:
            self.engine.restart_unhealthy()
            self.engine.push_weights(self.weights.snapshot(self.ref.state().items()), self.engine.version)


_FAMILIES = {"qwen2": {}, "llama": {"tie_word_embeddings": False}}  # qwen2 tied: vLLM's stale lm_head bug


def _spawn_families(root: pathlib.Path, families: tuple[str, ...]) -> dict[str, Served]:
    """A server for each family, spawned at once (their start-ups overlap), then connected."""
    from rljax.models.tiny import build_tiny_checkpoint
    from rljax.rollout import VLLMServer

    spawned = {}
    try:
        for family in families:
            path = str(build_tiny_checkpoint(root / family / "ckpt", family, **_FAMILIES[family]))
            server = VLLMServer(path, root / family / "workdir", options=TEST_SERVER_OPTIONS).spawn()
            spawned[family] = (server, path)
        served = {}
        for family, (server, path) in spawned.items():
            server.wait_healthy(TEST_SERVER_OPTIONS.startup_timeout_s)
            ref = TorchReference(path)
            engine = RolloutEngine.connect([server.url], path, servers=[server])
            served[family] = Served(engine, ref, path)
        return served
    except BaseException:
        for server, _ in spawned.values():
            server.stop()
        raise


def _stop_families(served: dict[str, Served]) -> None:
    for s in served.values():
        s.engine.close()


_FAMILY_SERVERS = Shared("vllm_families", _stop_families)


@pytest.fixture
def vllm_families(request, tmp_path_factory) -> dict[str, Served]:
    """A server for each family the collected tests use, started together, kept while their group runs."""

    def start() -> dict[str, Served]:  # the collection is scanned once per start, not once per test
        used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
        families = tuple(f for f in _FAMILIES if f"served_{f}" in used) or tuple(_FAMILIES)
        return _spawn_families(tmp_path_factory.mktemp("vllm_families"), families)

    return _FAMILY_SERVERS.get(start)


@pytest.fixture
def served_qwen2(vllm_families) -> Served:
    """The shared tiny-Qwen2 (tied) server, alive and serving `ref`'s weights."""
    vllm_families["qwen2"].ensure_servable()
    return vllm_families["qwen2"]


@pytest.fixture
def served_llama(vllm_families) -> Served:
    """The shared tiny-Llama (untied) server, alive and serving `ref`'s weights."""
    vllm_families["llama"].ensure_servable()
    return vllm_families["llama"]


ARITH_MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "assets" / "tiny_arith")


# One per worker (shared.py): its users are the longest tests of the suite; in one row they set its wall time.
_ARITH = Shared("arith_server", lambda server: server.stop(), per_worker=True)


class ArithServer:
    """The tiny_arith server of the moment, started (again) by the first use after a stop: a session
    fixture's value that module fixtures can hold, while the server itself lives only while its group's
    tests run (`shared.py`)."""

    model = ARITH_MODEL

    def __init__(self, root: Callable[[], pathlib.Path]):
        self._root = root

    def _server(self):
        return _ARITH.get(lambda: _start_arith(self._root()))

    @property
    def url(self) -> str:
        return self._server().url

    @property
    def token_file(self) -> str:
        """The server's bearer token (rollout.vllm.token_file)."""
        return str(self._server().token_file)

    def main_args(self) -> list[str]:
        """The `rljax.main` overrides that point a run at this server."""
        return [
            f"--config.model.path={self.model}",
            f"--config.rollout.vllm.urls=('{self.url}',)",
            f"--config.rollout.vllm.token_file={self.token_file}",
        ]


def _start_arith(root: pathlib.Path):
    from rljax.rollout import VLLMServer

    server = VLLMServer(ARITH_MODEL, root, options=TEST_SERVER_OPTIONS).spawn()
    try:
        server.wait_healthy(TEST_SERVER_OPTIONS.startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def arith_server(tmp_path_factory) -> ArithServer:
    """A tiny_arith server (TEST_SERVER_OPTIONS) for the end-to-end tests. Each run pushes its own weights
    first, so runs do not see each other's."""
    return ArithServer(lambda: tmp_path_factory.mktemp("vllm_arith"))


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
