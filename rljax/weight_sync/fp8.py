"""fp8 serving weights: per-tensor scaled float8 (e4m3) projections and their scales, as vLLM's fp8
checkpoints lay them out.

A checkpoint vLLM serves with `--quantization fp8` (the `fp8` method, dynamic activation scales) stores each
linear projection of a decoder layer as `<prefix>.weight` in float8_e4m3fn and `<prefix>.weight_scale`, a
float32 scalar, with `weight ~= float32(weight) * weight_scale`; everything else (embeddings, norms, the LM
head, biases) stays in bfloat16. `fp8_tensors` turns the trainer's `(hf_name, array)` stream into that
stream, one tensor at a time on the host: the scale is the tensor's absolute maximum over `FP8_MAX` (current
scaling: every push scales the weights it pushes, no history to keep across versions or resumes), values
are rounded to nearest even, and the per-element error of a dequantized weight is at most half a unit in
the last place of e4m3 (3 mantissa bits: 2^-4 of the value's binade) times the scale.

The server side needs vLLM's CUDA build: its CPU build has no fp8 kernels (`_C::static_scaled_fp8_quant`),
so the config refuses this dtype there (`rljax.config.validation`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(FP8).max)  # 448
# The projections vLLM quantizes in Llama/Qwen2/Qwen3 decoders (its fp8 LinearMethod): attention and MLP.
QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
SCALE_SUFFIX = "_scale"  # "<prefix>.weight" -> "<prefix>.weight_scale"


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 values f8[...], scale f32[]) of a float tensor: per-tensor absmax scaling, round to nearest."""
    w = np.asarray(w, np.float32)
    amax = float(np.max(np.abs(w))) if w.size else 0.0
    if not np.isfinite(amax):
        raise ValueError(f"cannot scale a tensor holding {amax} to fp8")
    scale = np.float32(amax / FP8_MAX if amax > 0 else 1.0)
    return np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(FP8), np.asarray(scale, np.float32)


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.float32(scale)


def is_quantized(name: str, array: np.ndarray) -> bool:
    return array.ndim == 2 and QUANTIZED.search(name) is not None


def fp8_tensors(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """The serving stream of an fp8 checkpoint: each projection weight as fp8 followed by its scale, every
    other tensor in bfloat16 (see the module docstring)."""
    for name, array in tensors:
        if is_quantized(name, array):
            q, scale = quantize(array)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, np.asarray(array).astype(ml_dtypes.bfloat16)
