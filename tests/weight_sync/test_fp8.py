"""fp8 serving weights on CPU (rljax.weight_sync.fp8): the quantization against ml_dtypes' own rounding,
dequantization within e4m3's error, bytes (projections a quarter of float32, plus one scale each), the
staged buckets through the wire and the worker's torch view, and the config refusing a CPU engine.
The server side (vLLM's fp8 kernels) needs a GPU: scripts/gpu_check.sh."""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

from rljax import config as C
from rljax import models
from rljax.weight_sync import fp8, stage_buckets, wire


def _tiny():
    config = models.ModelConfig(
        family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False, attention_bias=True,
    )  # fmt: skip
    params = jax.tree.map(np.asarray, models.init_params(config, jax.random.key(0)))
    return config, dict(models.iter_hf_tensors(config, params, "float32"))


def test_quantize_matches_the_reference_rounding_and_stays_within_e4m3_error():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 32)) * 0.05).astype(np.float32)
    w[3, 4] = -0.4  # the absmax
    q, scale = fp8.quantize(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32 and scale.shape == ()
    assert scale == np.float32(0.4 / 448.0)
    np.testing.assert_array_equal(
        q.view(np.uint8), (w / scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    )
    assert float(q[3, 4]) == -448.0  # the absmax lands on e4m3's largest value
    scaled = np.abs(w / scale)
    ulp = np.where(scaled >= 2.0**-6, 2.0 ** (np.floor(np.log2(np.maximum(scaled, 2.0**-6))) - 3), 2.0**-9)
    err = np.abs(fp8.dequantize(q, scale) - w)
    assert np.all(err <= scale * ulp / 2 * (1 + 1e-6)), float((err / (scale * ulp)).max())
    assert 0 < err.max() <= 0.4 * 2.0**-4  # lossy, and within half an ulp of the largest binade
    zeros, s0 = fp8.quantize(np.zeros((2, 2), np.float32))
    assert s0 == 1.0 and not np.any(zeros.astype(np.float32))
    with pytest.raises(ValueError, match="cannot scale"):
        fp8.quantize(np.float32([[np.inf]]))


def test_fp8_stream_quarters_the_projections_and_adds_one_scale_each():
    config, tensors = _tiny()
    out = dict(fp8.fp8_tensors(tensors.items()))
    projections = [n for n, a in tensors.items() if fp8.is_quantized(n, a)]
    assert len(projections) == 7 * config.num_layers  # q k v o gate up down per layer
    for name, array in tensors.items():
        if name in projections:
            assert out[name].dtype == ml_dtypes.float8_e4m3fn and out[name].nbytes * 4 == array.nbytes
            assert out[name + "_scale"].shape == () and out[name + "_scale"].dtype == np.float32
        else:  # embeddings, norms, biases, the LM head: bfloat16
            assert out[name].dtype == ml_dtypes.bfloat16 and out[name].nbytes * 2 == array.nbytes
    f32 = sum(tensors[n].nbytes for n in projections)
    assert sum(out[n].nbytes + out[n + "_scale"].nbytes for n in projections) == f32 // 4 + 4 * len(
        projections
    )
    assert set(out) == set(tensors) | {n + "_scale" for n in projections}


def test_fp8_buckets_cross_the_wire_and_the_worker_reads_them_as_torch_fp8(tmp_path):
    import torch

    from rljax.weight_sync.worker.engine import ShmWeightTransferEngine

    _, tensors = _tiny()
    served = dict(fp8.fp8_tensors(tensors.items()))
    (bucket,) = stage_buckets(iter(served.items()), bucket_bytes=1 << 20, directory=tmp_path, checksums=True)
    data = open(bucket.path, "rb").read()
    by_name = {e.name: e for e in bucket.entries}
    assert {e.dtype for e in bucket.entries} == {"float8_e4m3fn", "float32", "bfloat16"}
    assert wire.bucket_extent(bucket.entries) == len(data)
    for name, array in served.items():
        t = ShmWeightTransferEngine._tensor(data, by_name[name], copy=True)
        assert tuple(t.shape) == array.shape
        if array.dtype == ml_dtypes.float8_e4m3fn:
            assert t.dtype == torch.float8_e4m3fn
            np.testing.assert_array_equal(t.view(torch.uint8).numpy(), array.view(np.uint8))
        else:
            np.testing.assert_array_equal(t.float().numpy(), array.astype(np.float32))


def test_fp8_serving_is_refused_on_a_cpu_engine_and_asks_vllm_for_fp8():
    from rljax.rollout.server import ServerOptions, server_command

    cfg = C.from_config_dict({"rollout": {"weight_sync": {"dtype": "float8_e4m3"}}})
    assert C.serving_dtype(cfg) == "float8_e4m3" and C.canary_tolerance(cfg) == 1.0
    if C.vllm_is_cpu_build():
        with pytest.raises(C.ConfigError, match="rollout.weight_sync.dtype.*CPU build"):
            C.validate(cfg)
    remote = dataclasses.replace(cfg.rollout.vllm, urls=("http://10.0.0.9:8000",), allow_remote=True)
    C.validate(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm=remote)))  # GPU servers
    cmd = server_command("/m", "127.0.0.1", 1, ServerOptions(dtype="float8_e4m3", cpu_build=False))
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--quantization") + 1] == "fp8"


def test_a_push_in_fp8_streams_the_quantized_checkpoint_from_the_float32_masters():
    from rljax.loop.engine import JaxSnapshot

    config = models.ModelConfig(
        family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False, attention_bias=True,
    )  # fmt: skip
    params = models.init_params(config, jax.random.key(0))
    pushed = dict(JaxSnapshot(config, params, "float8_e4m3", None).tensors())
    _, reference = _tiny()
    expected = dict(fp8.fp8_tensors(reference.items()))
    assert pushed.keys() == expected.keys()
    for name, array in expected.items():
        assert pushed[name].dtype == array.dtype
        np.testing.assert_array_equal(np.asarray(pushed[name], np.float32), np.asarray(array, np.float32))
