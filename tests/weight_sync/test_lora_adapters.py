"""LoRA sync into a real vLLM server: versioned adapters, the canary under the adapter, the version race.

The trainer's side here is transformers in float32 on the merged weights (W + alpha/r * B @ A), the same
function a LoRA forward computes; the adapter tensors are random (B non-zero) so every target matters.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import requests

from rljax.rollout.auth import bearer_headers
from rljax.rollout.server import served_model_name
from rljax.weight_sync.adapters import (
    ADAPTER_FILE,
    TMP_PREFIX,
    AdapterPublisher,
    AdapterSyncError,
    adapter_name,
    clear_partial,
    lora_server_args,
    write_adapter,
)
from rljax.weight_sync.canary import CanaryError, CanarySpec

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(base: dict[str, np.ndarray], seed: int, scale: float = 0.3) -> dict[str, np.ndarray]:
    """PEFT tensors for every target projection of `base` (HF names): A f32[r, in], B f32[out, r]."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, w in base.items():
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        d_out, d_in = w.shape
        out[f"base_model.model.{module}.lora_A.weight"] = (scale * rng.standard_normal((RANK, d_in))).astype(
            np.float32
        )
        out[f"base_model.model.{module}.lora_B.weight"] = (scale * rng.standard_normal((d_out, RANK))).astype(
            np.float32
        )
    return out


def merged(base: dict[str, np.ndarray], adapter: dict[str, np.ndarray], alpha: float) -> dict:
    state = dict(base)
    for key in adapter:
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        a, b = adapter[key], adapter[key.replace(".lora_A.", ".lora_B.")]
        state[f"{module}.weight"] = (base[f"{module}.weight"] + (alpha / RANK) * (b @ a)).astype(np.float32)
    return state


def peft_config(alpha: float = ALPHA) -> dict:
    return {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": alpha,
        "target_modules": list(TARGETS),
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
        "lora_dropout": 0.0,
    }


# --- the directory, without a server ---


def test_an_adapter_directory_appears_whole_or_not_at_all(tmp_path):
    tensors = {"base_model.model.x.lora_A.weight": np.ones((2, 3), np.float32)}
    path = write_adapter(tmp_path, 3, tensors, peft_config())
    assert path == tmp_path / "v3" and sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        ADAPTER_FILE,
    ]
    assert json.loads((path / "adapter_config.json").read_text())["r"] == RANK
    assert not list(tmp_path.glob(f"{TMP_PREFIX}*"))  # nothing left under a temporary name
    # A crash mid-write leaves only a temporary directory, which no adapter name points at; the next
    # publisher removes it.
    (tmp_path / f"{TMP_PREFIX}v4-1-2").mkdir()
    assert clear_partial(tmp_path) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["v3"]


def test_lora_server_args_round_the_rank_up_to_one_vllm_accepts():
    args, env = lora_server_args(12)
    assert args == ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2")
    assert dict(env) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with pytest.raises(ValueError, match="above vLLM's largest"):
        lora_server_args(1000)


# --- against a real vLLM server with runtime LoRA ---


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    import dataclasses

    from support.vllm_server import TEST_SERVER_OPTIONS, TorchReference

    from rljax.models.tiny import build_tiny_checkpoint
    from rljax.rollout import VLLMServer

    root = tmp_path_factory.mktemp("lora")
    path = str(build_tiny_checkpoint(root / "ckpt", "qwen2"))
    args, env = lora_server_args(RANK)
    options = dataclasses.replace(TEST_SERVER_OPTIONS, extra_args=args, extra_env=env)
    server = VLLMServer(path, root / "workdir", options=options).spawn()
    try:
        server.wait_healthy(options.startup_timeout_s)
        yield server, path, TorchReference(path), root / "adapters"
    finally:
        server.stop()


def _canary(vocab: int = 512) -> CanarySpec:
    rng = np.random.default_rng(7)
    return CanarySpec(
        tuple(int(t) for t in rng.integers(0, vocab, 40)), tuple(int(t) for t in rng.integers(0, vocab, 8))
    )


def _served_names(server) -> set[str]:
    resp = requests.get(f"{server.url}/v1/models", headers=_headers(server), timeout=30)
    return {m["id"] for m in resp.json()["data"]}


def _headers(server) -> dict:
    return bearer_headers(server.token)


def _publisher(server, path, root) -> AdapterPublisher:
    base = served_model_name(server.url, headers=_headers(server))
    return AdapterPublisher(
        [server.url], root, base, canary=_canary(), headers=_headers(server), canary_tolerance=1e-4
    )


def push_checked(pub, ref, base, seed: int, version: int) -> tuple[dict, dict]:
    """Publishes a random adapter as `version`, the canary answered by `ref` holding the merged weights;
    returns (adapter, metrics)."""
    adapter = random_adapter(base, seed)
    ref.load(merged(base, adapter, ALPHA))
    return adapter, pub.publish(adapter, peft_config(), version, logprobs=ref.logprobs)


@pytest.mark.vllm
def test_a_pushed_adapter_serves_the_merged_models_logprobs(lora_server):
    server, path, ref, root = lora_server
    base = ref.state()
    pub = _publisher(server, path, root)
    try:
        for version, seed in ((1, 0), (2, 1)):
            adapter, metrics = push_checked(pub, ref, base, seed, version)
            assert pub.current == (adapter_name(version, pub.run), version)
            assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= 1e-4
            assert metrics["weight_sync/bytes"] == sum(v.nbytes for v in adapter.values())
            # only the adapter moves: a fraction of the model's bytes
            assert metrics["weight_sync/bytes"] < 0.25 * sum(v.nbytes for v in base.values())
            # the previous version (no request in flight) is unloaded and its directory gone
            assert _served_names(server) & {adapter_name(1, pub.run), adapter_name(2, pub.run)} == {
                adapter_name(version, pub.run)
            }
            assert sorted(p.name for p in root.iterdir()) == [f"v{version}"]
    finally:
        pub.close()
        ref.load(base)


@pytest.mark.vllm
@pytest.mark.parametrize("wrong", ["scale", "transposed"])
def test_the_canary_fails_a_wrong_adapter_and_the_previous_version_keeps_serving(lora_server, wrong):
    server, path, ref, root = lora_server
    base = ref.state()
    pub = _publisher(server, path, root)
    try:
        push_checked(pub, ref, base, 3, 1)
        bad = random_adapter(base, 4)
        if wrong == "scale":  # the served scale is alpha / r; the trainer's twice that
            ref.load(merged(base, bad, 2 * ALPHA))
        else:  # the trainer applies A^T B^T (square projections only), vLLM B A
            ref.load(merged(base, {k: _transposed(k, v, bad) for k, v in bad.items()}, ALPHA))
        with pytest.raises(CanaryError, match=adapter_name(2, pub.run)):
            pub.publish(bad, peft_config(), 2, logprobs=ref.logprobs)
        assert pub.current == (adapter_name(1, pub.run), 1) and adapter_name(2, pub.run) not in _served_names(
            server
        )
        assert not (root / "v2").exists()
    finally:
        pub.close()
        ref.load(base)


def _transposed(key: str, value: np.ndarray, adapter: dict) -> np.ndarray:
    """A -> B^T and B -> A^T where the projection is square (q_proj, o_proj); others unchanged."""
    other = adapter[
        key.replace(".lora_A.", ".lora_B.") if ".lora_A." in key else key.replace(".lora_B.", ".lora_A.")
    ]
    return other.T.copy() if other.T.shape == value.shape else value


@pytest.mark.vllm
def test_a_push_while_requests_of_the_previous_version_are_in_flight(lora_server):
    """The previous adapter stays loaded while a request sampled with it is in flight, answers that
    request after the newer version is current, and is unloaded (directory removed) when it ends."""
    server, path, ref, root = lora_server
    base = ref.state()
    pub = _publisher(server, path, root)
    try:
        pub.publish(random_adapter(base, 5), peft_config(), 1)
        leased, pushed, result = threading.Event(), threading.Event(), {}

        def request():
            with pub.lease() as (name, version):
                leased.set()
                pushed.wait(120)
                body = {"model": name, "prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0.0}
                resp = requests.post(
                    f"{server.url}/v1/completions", json=body, headers=_headers(server), timeout=60
                )
                result.update(name=name, version=version, status=resp.status_code, text=resp.text)

        t = threading.Thread(target=request)
        t.start()
        assert leased.wait(60)
        pub.publish(random_adapter(base, 6), peft_config(), 2)
        assert pub.current == (adapter_name(2, pub.run), 2)
        assert {adapter_name(1, pub.run), adapter_name(2, pub.run)} <= _served_names(server) and (
            root / "v1"
        ).is_dir()
        pushed.set()
        t.join(120)
        assert (
            result["status"] == 200 and result["version"] == 1 and result["name"] == adapter_name(1, pub.run)
        )
        assert adapter_name(1, pub.run) not in _served_names(server) and not (root / "v1").exists()
        assert pub.in_flight(adapter_name(1, pub.run)) == 0 and pub.loaded() == [adapter_name(2, pub.run)]
    finally:
        pub.close()


@pytest.mark.vllm
def test_an_adapter_the_server_cannot_load_is_refused_and_nothing_switches(lora_server):
    server, path, ref, root = lora_server
    base = ref.state()
    pub = _publisher(server, path, root)
    try:
        too_big = random_adapter(base, 8)
        config = dict(peft_config(), r=64)  # above the server's --max-lora-rank
        with pytest.raises(AdapterSyncError, match=adapter_name(1, pub.run)):
            pub.publish(too_big, config, 1)
        assert pub.current[1] == 0 and pub.loaded() == [] and not (root / "v1").exists()
    finally:
        pub.close()


@pytest.mark.vllm
def test_a_restarted_server_gets_the_current_adapter_again_by_the_re_push(lora_server):
    """Recovery's path: a server restarted from its checkpoint has no adapter (it no longer serves the
    version); re-pushing the current version loads it there, the canary passes, nothing retires."""
    server, path, ref, root = lora_server
    base = ref.state()
    pub = _publisher(server, path, root)
    try:
        adapter, _ = push_checked(pub, ref, base, 11, 3)
        assert pub.server_version(server.url) == "3" and pub.gate.version == 3
        server.stop()
        server.spawn()
        server.wait_healthy(server.options.startup_timeout_s)
        assert pub.server_version(server.url) == ""  # the restarted server lists no adapter
        metrics = pub.publish(adapter, peft_config(), 3, logprobs=ref.logprobs)
        assert (
            metrics["weight_sync/canary_logprob_max_abs_diff"] <= 1e-4
            and pub.server_version(server.url) == "3"
        )
        assert pub.loaded() == [adapter_name(3, pub.run)] and (root / "v3").is_dir()
    finally:
        pub.close()
        ref.load(base)
