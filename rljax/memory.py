"""Per-device memory of the trainer's jitted functions, read from the compiler (nothing is allocated).

The real train step of `algo.family` (`trainer.families`: the GRPO-family or the PPO step) and the
log-prob passes (`trainer.make_logprob_fn`: old log-probs over the whole rollout batch, reference
log-probs when `algo.beta > 0`) are lowered and compiled from `jax.ShapeDtypeStruct`s that carry their
target shardings, and `compiled.memory_analysis()` gives, per device:

    argument + output + temp - alias     (donated buffers, e.g. the train state, counted once)

`resident_bytes` adds what the run holds beside each function's own arguments (the optimizer state
during the log-prob passes, the reference copy during the step, ...), so `total_bytes` is what one
device must hold while that function runs.

Usage (8 simulated CPU devices stand in for 8 accelerators):
    shapes = TrainShapes(rows=512, seq_len=8192, train_rows=512)
    report = compiled_train_memory(cfg, model_config, mesh, shapes)
    report["train_step"].peak_bytes
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from rljax import models
from rljax.algos import FAMILIES
from rljax.config import Config
from rljax.models import lora
from rljax.trainer.batch import TrainBatch
from rljax.trainer.families import make_family_train_step
from rljax.trainer.logprobs import make_logprob_fn
from rljax.trainer.optim import make_optimizer, total_optimizer_steps
from rljax.trainer.packing import packed_row_length
from rljax.trainer.state import (
    TrainState,
    abstract_critic,
    abstract_trainable,
    base_shardings,
    batch_sharding,
    resolve_model_config,
    state_shardings,
)
from rljax.types import LossInputs

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes of one compiled function (`compiled.memory_analysis()`) and its compile time.

    Fields:
      argument_bytes, output_bytes, temp_bytes, alias_bytes: the compiler's figures for one device
        (alias: outputs written into donated arguments).
      compile_s: seconds to lower and compile.
      resident_bytes: other buffers the run holds on the device while this function runs.
      hlo: the compiled HLO text when asked for (`compiled.as_text()`), else "".
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    compile_s: float
    resident_bytes: int = 0
    hlo: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def peak_bytes(self) -> int:
        """argument + output + temp - alias: the function's own footprint, donated buffers counted once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def total_bytes(self) -> int:
        """peak_bytes plus the run's other resident buffers: what the device holds while this runs."""
        return self.peak_bytes + self.resident_bytes

    def as_dict(self) -> dict[str, float]:
        """The numbers (no HLO) plus peak_bytes and total_bytes."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "hlo"}
        return out | {"peak_bytes": self.peak_bytes, "total_bytes": self.total_bytes}


@dataclasses.dataclass(frozen=True)
class TrainShapes:
    """The shapes to compile for.

    rows: rollout rows per step (the old/reference passes run over all of them).
    seq_len: tokens per row (the longest length bucket).
    train_rows: rows of one train step's minibatch (micro-batched inside by trainer.micro_batch_size).
    """

    rows: int
    seq_len: int
    train_rows: int


def shapes_from_config(cfg: Config) -> TrainShapes:
    """What a run compiles at its largest: `rollout.batch_size` rows of `rollout.vllm.max_model_len`
    tokens, minibatches of `rollout.batch_size / trainer.minibatches` rows. Packed
    (`trainer.tokens_per_micro_batch` N > 0): rows of N tokens, at most one per sequence, grown like the
    packer grows them for a `max_model_len` sequence (`packing.packed_row_length`)."""
    rows = cfg.rollout.batch_size
    max_len = cfg.rollout.vllm.max_model_len
    n = cfg.trainer.tokens_per_micro_batch
    seq_len = packed_row_length(n, max_len) if n else max_len
    return TrainShapes(rows=rows, seq_len=seq_len, train_rows=rows // cfg.trainer.minibatches)


# ---------------------------------------------------------------------------------- abstract inputs
def with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStruct tree `abstract` with each leaf carrying its NamedSharding from `shardings`."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def abstract_train_state(
    cfg: Config, model_config: models.ModelConfig, mesh: Mesh, optimizer: optax.GradientTransformation
) -> TrainState:
    """TrainState of ShapeDtypeStructs with their target shardings, from `jax.eval_shape` of the init
    (master params in `cfg.model.param_dtype`; PPO adds the critic and its optimizer state)."""
    resolved = resolve_model_config(cfg, model_config)
    critic = FAMILIES.get(cfg.algo.family).critic

    def init(params, critic_params):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            nonfinite_count=jnp.zeros((), jnp.int32),
            critic_params=critic_params,
            critic_opt_state=None if critic_params is None else optimizer.init(critic_params),
        )

    abstract = jax.eval_shape(
        init, abstract_trainable(resolved), abstract_critic(resolved) if critic else None
    )
    return with_shardings(abstract, state_shardings(resolved, mesh, optimizer, critic=critic))


def abstract_lora_base(cfg: Config, model_config: models.ModelConfig, mesh: Mesh) -> Any:
    """The frozen base of a LoRA run (`cfg.model.lora_rank > 0`) as ShapeDtypeStructs in the compute
    dtype with their shardings (what `rljax.loop.setup.load_policy` holds), else None."""
    resolved = resolve_model_config(cfg, model_config)
    if not resolved.lora_rank:
        return None
    dtype = jnp.dtype(cfg.model.compute_dtype)
    base = lora.split_params(models.abstract_params(resolved))[0]
    base = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), base)
    return with_shardings(base, base_shardings(resolved, mesh))


def abstract_loss_inputs(cfg: Config, rows: int, seq_len: int, mesh: Mesh) -> LossInputs:
    """LossInputs of ShapeDtypeStructs `[rows, seq_len]` / `[rows]` (`[rows, seq_len]` when packed),
    rows sharded like a batch."""
    s = batch_sharding(mesh)
    tok = lambda dtype: jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=s)  # noqa: E731
    seq_shape = (rows, seq_len) if cfg.trainer.tokens_per_micro_batch else (rows,)
    seq = lambda dtype: jax.ShapeDtypeStruct(seq_shape, dtype, sharding=s)  # noqa: E731
    return LossInputs(
        input_ids=tok(jnp.int32),
        target_ids=tok(jnp.int32),
        positions=tok(jnp.int32),
        segment_ids=tok(jnp.int32),
        loss_mask=tok(jnp.float32),
        behavior_logp=tok(jnp.float32),
        advantages=seq(jnp.float32),
        rewards=seq(jnp.float32),
        group_ids=seq(jnp.int32),
        policy_version=seq(jnp.int32),
        temperature=cfg.rollout.temperature,
    )


def abstract_train_batch(cfg: Config, rows: int, seq_len: int, mesh: Mesh) -> TrainBatch:
    """The TrainBatch a train step receives: old log-probs, reference log-probs when algo.beta > 0, and
    for a family with a critic (PPO) token-level advantages, returns and old values."""
    inputs = abstract_loss_inputs(cfg, rows, seq_len, mesh)
    token = inputs.loss_mask
    critic = FAMILIES.get(cfg.algo.family).critic
    return TrainBatch(
        inputs=inputs,
        old_logp=token,
        advantages=token if critic else inputs.advantages,
        ref_logp=token if cfg.algo.needs_reference else None,
        returns=token if critic else None,
        old_values=token if critic else None,
    )


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a ShapeDtypeStruct tree with shardings (the largest shard of each)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


# ---------------------------------------------------------------------------------------- compiling
def compile_memory(
    jitted: Any, *args: Any, resident_bytes: int = 0, with_hlo: bool = False
) -> CompiledMemory:
    """Lowers and compiles `jitted` for `args` (ShapeDtypeStructs) and reads its memory analysis
    (and, `with_hlo`, keeps the compiled HLO text). Raises RuntimeError when the backend reports none.
    """
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"the {jax.default_backend()} backend reports no memory analysis")
    return CompiledMemory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        compile_s=seconds,
        resident_bytes=resident_bytes,
        hlo=compiled.as_text() if with_hlo else "",
    )


def compiled_train_memory(
    cfg: Config,
    model_config: models.ModelConfig,
    mesh: Mesh,
    shapes: TrainShapes,
    *,
    with_hlo: bool = False,
) -> dict[str, CompiledMemory]:
    """Compiled per-device memory of `train_step`, `old_logprobs` and (algo.beta > 0) `ref_logprobs`.

    `model_config` gives the shapes (its dtype, remat and attention fields are overridden by
    `cfg.model`, as in the run). The reference pass is the old pass's executable (one
    `make_logprob_fn` serves both in trainer/update.py; the reference copy has the policy's shapes,
    dtype and shardings), so it is compiled once. Resident bytes: during the step, the reference copy
    and (when a step sees a minibatch) the whole rollout batch; during the old pass, the optimizer
    state(s) and the reference copy; during the reference pass, the whole state and the old log-probs.
    """
    optimizer = make_optimizer(cfg.optim, total_optimizer_steps(cfg))
    state = abstract_train_state(cfg, model_config, mesh, optimizer)
    base = abstract_lora_base(cfg, model_config, mesh)  # LoRA: an argument of every function
    extra, policy = ((), state.params) if base is None else ((base,), lora.combine(base, state.params))
    full = abstract_train_batch(cfg, shapes.rows, shapes.seq_len, mesh)
    minibatch = abstract_train_batch(cfg, shapes.train_rows, shapes.seq_len, mesh)
    # LoRA: the reference is the base (already an argument), no second copy.
    ref = device_bytes(state.params) if cfg.algo.needs_reference and base is None else 0
    batch_held = device_bytes(full) if shapes.train_rows < shapes.rows else 0
    others = device_bytes(state) - device_bytes(state.params)  # optimizer state(s), critic
    step = make_family_train_step(cfg, model_config, mesh, optimizer=optimizer)
    report = {
        "train_step": compile_memory(
            step, state, minibatch, *extra, resident_bytes=ref + batch_held, with_hlo=with_hlo
        ),
        "old_logprobs": compile_memory(
            make_logprob_fn(cfg, model_config, mesh),
            policy,
            full.inputs,
            resident_bytes=others + ref,
            with_hlo=with_hlo,
        ),
    }
    if cfg.algo.needs_reference:
        held = device_bytes(state) + device_bytes(full.old_logp)
        report["ref_logprobs"] = dataclasses.replace(report["old_logprobs"], resident_bytes=held)
    return report


def peak_function(report: dict[str, CompiledMemory]) -> str:
    """Name of the function whose `total_bytes` is largest."""
    return max(report, key=lambda name: report[name].total_bytes)


def format_report(report: dict[str, CompiledMemory]) -> str:
    """One line: per function, GiB per device (3 significant digits) of the total held, then arguments,
    outputs, temporaries, aliased and resident buffers."""
    gib = lambda n: f"{n / GIB:.3g}"  # noqa: E731
    return "; ".join(
        f"{name} {gib(m.total_bytes)} (argument {gib(m.argument_bytes)}, output {gib(m.output_bytes)}, "
        f"temp {gib(m.temp_bytes)}, alias {gib(m.alias_bytes)}, resident {gib(m.resident_bytes)})"
        for name, m in report.items()
    )
