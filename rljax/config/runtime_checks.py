"""Config checks that need the machine: the mesh against the device count, the model directory and its
shapes against the mesh, the tokenizer's chat template (`validate_runtime`).

rljax.models (and so JAX) is imported inside these functions, not at the top: rljax.config is read by the
CLI before it sets the platform and device-count flags that JAX reads (rljax.runtime).
"""

from __future__ import annotations

import os
from typing import Any

from rljax.config.packing_checks import SPLASH_SHARED_PROMPTS
from rljax.config.schema import FP8_SERVING, Config, ConfigError, DataConfig, serving_dtype
from rljax.config.validation import mesh_shape
from rljax.kernels import check_backend


def check_chat_template(data: DataConfig, tokenizer_path: str) -> None:
    """ConfigError on data.chat_template when the checkpoint's tokenizer has no chat template (loads the
    tokenizer the run will use, so what is checked is what renders)."""
    if not data.chat_template:
        return
    from rljax import models

    try:
        tokenizer = models.load_tokenizer(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ConfigError("model.path", f"cannot load its tokenizer: {type(e).__name__}: {e}") from e
    if not tokenizer.chat_template:
        raise ConfigError(
            "data.chat_template",
            f"the tokenizer in {tokenizer_path!r} has no chat template (chat_template.jinja, or "
            "chat_template in tokenizer_config.json); add one or set data.chat_template=false",
        )


def validate_runtime(cfg: Config, num_devices: int, num_processes: int = 1) -> dict[str, int]:
    """Checks that need the machine, before anything is allocated: mesh vs device count, that
    `trainer.logprob_impl` runs on this backend, the model directory, the micro-batch vs data parallelism,
    (unless `mesh.allow_replication`) that every mesh axis divides each dimension the sharding rules give
    it (`check_mesh_divides_model`), and that the tokenizer has a chat template when `data.chat_template`
    is set. Returns mesh sizes."""
    sizes = mesh_shape(cfg.mesh, num_devices)
    if cfg.trainer.logprob_impl != "auto":
        try:
            check_backend(cfg.trainer.logprob_impl)
        except ValueError as e:
            raise ConfigError("trainer.logprob_impl", str(e)) from None
    if cfg.trainer.share_prompts:
        from rljax.models.attention import resolve_attention_impl, sees_shared_prompts

        if not sees_shared_prompts(resolve_attention_impl(cfg.model.attention_impl, cfg.model.compute_dtype)):
            raise ConfigError("model.attention_impl", SPLASH_SHARED_PROMPTS)
    if serving_dtype(cfg) == FP8_SERVING and num_processes > 1:
        raise ConfigError(
            "rollout.weight_sync.dtype",
            f"{FP8_SERVING} scales each tensor by its maximum over the whole tensor; a job of "
            f"{num_processes} processes stages shards (not yet supported with fp8): use bfloat16",
        )
    path = cfg.model.path
    if not os.path.isdir(path):
        raise ConfigError("model.path", f"no such directory: {path!r} (a local Hugging Face checkpoint)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("model.path", f"{path!r} has no config.json (not a Hugging Face checkpoint)")
    data_parallel = sizes["data"] * sizes["fsdp"]
    minibatch = cfg.rollout.batch_size // cfg.trainer.minibatches
    micro = cfg.trainer.micro_batch_size or minibatch
    # Packed rows are rounded up to a multiple of data*fsdp by the packer; only unpacked rows must split.
    if not cfg.trainer.tokens_per_micro_batch and micro % data_parallel:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"the micro-batch of {micro} sequences is not divisible by data*fsdp = {data_parallel}",
        )
    if not cfg.mesh.allow_replication:
        decoder = "" if cfg.model.family == "auto" else cfg.model.family
        check_mesh_divides_model(read_model_config(path, decoder), sizes)
    check_chat_template(cfg.data, path)
    return sizes


def read_model_config(path: str, decoder: str = "") -> Any:
    """The `rljax.models.ModelConfig` (shapes only, no weights) of the checkpoint's `config.json`
    (`decoder`: the decoder class, see `ModelConfig.decoder`)."""
    from rljax import models

    try:
        return models.read_model_config(path, decoder=decoder)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as e:
        # any malformed config.json (not JSON, not an object, missing or ill-typed or zero sizes)
        raise ConfigError("model.path", f"{path}/config.json: {type(e).__name__}: {e}") from e


def check_mesh_divides_model(model_config: Any, sizes: dict[str, int]) -> None:
    """ConfigError naming `mesh.<axis>` (or `mesh` when several fail) when a mesh axis of size > 1 does not
    divide a dimension the logical rules shard on it, for every parameter (`param_logical_axes`) and the
    attention activations sharded over heads (`attention.queries`, per token `[H, head_dim]`) and KV
    heads (`attention.keys`, `attention.values`: `[K, head_dim]`). One line per tensor, with the valid
    sizes (`rljax.sharding.check_divisibility`). `sizes`: resolved {data, fsdp, tensor}."""
    from rljax import models, sharding

    c = model_config
    attention = {
        "queries": sharding.LogicalAxes(("heads", "head_dim"), (c.num_heads, c.head_dim)),
        "keys": sharding.LogicalAxes(("kv", "head_dim"), (c.num_kv_heads, c.head_dim)),
        "values": sharding.LogicalAxes(("kv", "head_dim"), (c.num_kv_heads, c.head_dim)),
    }
    problems = sharding.divisibility_problems({**models.param_logical_axes(c), "attention": attention}, sizes)
    if not problems:
        return
    axes = sorted({p.axis for p in problems}, key=list(sizes).index)
    raise ConfigError(
        f"mesh.{axes[0]}" if len(axes) == 1 else "mesh",
        "; ".join(map(str, problems))
        + " (set mesh.allow_replication=true to replicate these dimensions over the mesh axis instead)",
    )
