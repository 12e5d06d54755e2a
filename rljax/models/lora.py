"""LoRA over pure param dicts: split, combine, init, merge, and the PEFT adapter (tensors and config).

With `config.lora_rank > 0` the decoder's params (`rljax.models.abstract_params(config)`) are the base
model's plus an adapter pair `kernel_lora_a [*stack, *in, r]` / `kernel_lora_b [*stack, r, *out]` next
to each targeted kernel (`rljax.models.adapters`). The trainer trains only the adapter
(`split_params`); the frozen base is the checkpoint's params, unchanged (`base_config`'s params).
A forward of `combine(base, adapter)` computes `y = x W + (alpha / r) (x A) B` per targeted projection;
`merged_params` folds the adapter into the weights (export, the full-model weight push).

PEFT layout (what vLLM's `enable_lora` and `peft.PeftModel` load): per layer and target,
`base_model.model.<hf module>.lora_A.weight f32[r, in]` and `...lora_B.weight f32[out, r]`, with
`W_hf + (lora_alpha / r) * lora_B @ lora_A` the merged HF weight; `in`/`out` flatten the kernel's dims
in the order its HF table row does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import adapters, layers
from rljax.models.config import ModelConfig
from rljax.models.model import abstract_params, param_entries, param_logical_axes
from rljax.models.params import ParamEntry, flatten_paths, get_path, nest_paths

PEFT_PREFIX = "base_model.model."


def base_config(config: ModelConfig) -> ModelConfig:
    """`config` without LoRA: the model whose params are the frozen base (and the merged params)."""
    return dataclasses.replace(config, lora_rank=0)


def split_params(params: dict) -> tuple[dict, dict]:
    """(base, adapter) of a LoRA model's param tree (any leaves: arrays, shapes, shardings, axes)."""
    pairs = flatten_paths(params)
    base = [(p, x) for p, x in pairs if not adapters.is_adapter_path(p)]
    return nest_paths(base), nest_paths([(p, x) for p, x in pairs if adapters.is_adapter_path(p)])


def combine(base: dict, adapter: dict) -> dict:
    """The LoRA model's param tree from its two parts (no copies: the leaves are shared)."""
    return nest_paths(flatten_paths(base) + flatten_paths(adapter))


def abstract_adapter(config: ModelConfig) -> dict:
    """ShapeDtypeStruct tree of the adapter (in `config.param_dtype`)."""
    return split_params(abstract_params(config))[1]


def adapter_logical_axes(config: ModelConfig) -> dict:
    """`LogicalAxes` tree of the adapter (A keeps the kernel's input names, B its output names)."""
    return split_params(param_logical_axes(config))[1]


def _stack_dims(config: ModelConfig, path: tuple[str, ...]) -> int:
    return sum(1 for n in get_path(param_logical_axes(config), path) if n == "layers")


def init_adapter(config: ModelConfig, key: jax.Array) -> dict:
    """A fresh adapter: B zero (so the model starts as the base), A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's
    kaiming-uniform), one key per leaf folded from `key`. Never builds the base weights."""
    out = []
    for i, (path, spec) in enumerate(flatten_paths(abstract_adapter(config))):
        if path[-1].endswith("_lora_b"):
            out.append((path, jnp.zeros(spec.shape, spec.dtype)))
            continue
        fan_in = math.prod(spec.shape[_stack_dims(config, path) : -1])
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), spec.shape, jnp.float32, -bound, bound)
        out.append((path, a.astype(spec.dtype)))
    return nest_paths(out)


def _pairs(config: ModelConfig, adapter: dict) -> list[tuple[tuple[str, ...], Any, Any]]:
    """[(weight path, A, B)] of every adapted weight, in the adapter's order."""
    out = []
    for path, a in flatten_paths(adapter):
        if path[-1].endswith("_lora_a"):
            weight = (*path[:-1], path[-1].removesuffix("_lora_a"))
            out.append((weight, a, get_path(adapter, (*weight[:-1], weight[-1] + "_lora_b"))))
    return out


def merged_params(config: ModelConfig, base: dict, adapter: dict) -> dict:
    """Params of `base_config(config)` with every adapted weight `W + (alpha / r) A B` (float32 math,
    the base's dtype). Jit-able (config static); the base is not modified."""
    scale, merged = adapters.lora_scale(config), dict(flatten_paths(base))
    for path, a, b in _pairs(config, adapter):
        w = merged[path]
        delta = layers.lora_weight_delta(a, b, _stack_dims(config, path))
        merged[path] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
    return nest_paths(list(merged.items()))


def _peft_rows(config: ModelConfig) -> dict[tuple[str, ...], list[ParamEntry]]:
    """HF table entries of each adapted weight path."""
    rows: dict[tuple[str, ...], list[ParamEntry]] = {}
    for e in param_entries(config):
        rows.setdefault(e.path, []).append(e)
    return rows


def _peft_layout(e: ParamEntry, n_in: int) -> int | None:
    """Checks the kernel's HF layout is `[out, in]` (dims kept in order) -> the B axis of `e.part`."""
    n = len(e.shape)
    if e.perm != (*range(n_in, n), *range(n_in)) or e.groups != (n - n_in, n_in):
        if not (n == 2 and n_in == 1 and e.perm == (1, 0)):
            raise NotImplementedError(f"{e.hf_name}: PEFT export needs an [out, in] HF layout")
    if e.part is None:
        return None
    if e.part[0] < n_in:
        raise NotImplementedError(f"{e.hf_name}: a part along an input dim has no PEFT equivalent")
    return e.part[0] - n_in + 1


def _peft_pair(e: ParamEntry, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (lora_A f32[r, in], lora_B f32[out, r]) of HF tensor `e`, from A `[*in, r]` and
    B `[r, *out]`."""
    r = a.shape[-1]
    axis = _peft_layout(e, a.ndim - 1)
    if axis is not None:
        b = np.take(b, np.arange(e.part[1], e.part[2]), axis=axis)
    lora_a = a.reshape(-1, r).T.astype(np.float32)
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(b.reshape(r, -1).T.astype(np.float32))


def _peft_name(hf_name: str, which: str) -> str:
    module = hf_name.removesuffix(".weight")
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def peft_tensors(config: ModelConfig, adapter: dict) -> dict[str, np.ndarray]:
    """The adapter as PEFT tensors `{name: f32 array}` (names and layouts in the module docstring), in
    Hugging Face state-dict order (layer by layer). Raises NotImplementedError for a kernel whose HF
    layout PEFT cannot express."""
    pairs = {path: (np.asarray(a), np.asarray(b)) for path, a, b in _pairs(config, adapter)}
    entries = [e for e in param_entries(config) if e.path in pairs]
    jobs = [(e, layer) for layer in range(config.num_layers) for e in entries if e.per_layer]
    jobs += [(e, None) for e in entries if not e.per_layer]
    out = {}
    for e, layer in jobs:
        a, b = pairs[e.path]
        lora_a, lora_b = _peft_pair(e, *((a, b) if layer is None else (a[layer], b[layer])))
        name = e.hf_name if layer is None else e.hf_name.format(layer)
        out[_peft_name(name, "A")], out[_peft_name(name, "B")] = lora_a, lora_b
    return out


def target_modules(config: ModelConfig) -> list[str]:
    """The HF module names (last component, e.g. `q_proj`) that carry an adapter, sorted."""
    rows = _peft_rows(config)
    paths = [path for path, _, _ in _pairs(config, abstract_adapter(config))]
    return sorted({e.hf_name.removesuffix(".weight").split(".")[-1] for p in paths for e in rows[p]})


def peft_config(config: ModelConfig, base_model_name_or_path: str = "") -> dict:
    """`adapter_config.json` for PEFT and vLLM: LoRA, rank, alpha, the HF target modules, no dropout,
    no bias, a causal LM over `base_model_name_or_path`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": target_modules(config),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "base_model_name_or_path": base_model_name_or_path,
    }
