"""Config checks of the update's packed layout: `trainer.tokens_per_micro_batch`, its micro-batches and
`trainer.share_prompts` (called by `validation.validate`; `runtime_checks` adds what needs the backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rljax.config.schema import Config, ConfigError

if TYPE_CHECKING:
    from rljax.algos import Family

SPLASH_SHARED_PROMPTS = (
    "splash attention compares segment ids only and cannot see a shared prompt "
    "(trainer.share_prompts=true): use 'blockwise', or set trainer.share_prompts=false"
)


def validate_packing(cfg: Config, family: Family) -> None:
    """Packing (`trainer.tokens_per_micro_batch`) and its micro-batches and shared prompts."""
    tr = cfg.trainer
    if tr.tokens_per_micro_batch < 0:
        raise ConfigError(
            "trainer.tokens_per_micro_batch", f"must be >= 0 (0: no packing), got {tr.tokens_per_micro_batch}"
        )
    if tr.packed_rows_per_micro_batch < 0:
        raise ConfigError(
            "trainer.packed_rows_per_micro_batch",
            f"must be >= 0 (0: the whole minibatch in one micro-batch), got {tr.packed_rows_per_micro_batch}",
        )
    if not tr.tokens_per_micro_batch:
        if tr.share_prompts:
            raise ConfigError(
                "trainer.share_prompts",
                "shares a prompt inside packed rows: set trainer.tokens_per_micro_batch > 0 too, or false",
            )
        return
    if tr.share_prompts:
        _validate_shared_prompts(cfg)
    if tr.micro_batch_size:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"must be 0 with packing (trainer.tokens_per_micro_batch={tr.tokens_per_micro_batch}): "
            "a micro-batch is then one packed row per data-parallel device",
        )
    if not family.packing:
        raise ConfigError(
            "trainer.tokens_per_micro_batch",
            f"packing is not available for algo.family={cfg.algo.family!r}: {family.note}",
        )
    if tr.tokens_per_micro_batch <= cfg.rollout.max_tokens:
        raise ConfigError(
            "trainer.tokens_per_micro_batch",
            f"{tr.tokens_per_micro_batch} cannot hold a prompt and "
            f"rollout.max_tokens={cfg.rollout.max_tokens} completion tokens",
        )


def _validate_shared_prompts(cfg: Config) -> None:
    """Shared prompts need an attention that sees the prompt segment: rljax's decoders with an
    implementation that applies `layers.attention_mask` (not splash; "auto": `runtime_checks`)."""
    from rljax.models.attention import sees_shared_prompts
    from rljax.models.model import has_rljax_attention

    if not has_rljax_attention(cfg.model.family):
        raise ConfigError(
            "trainer.share_prompts",
            f"needs a built-in decoder (model.family={cfg.model.family!r} brings its own attention mask, "
            "which does not see a shared prompt's segment): set it false",
        )
    impl = cfg.model.attention_impl
    if impl != "auto" and not sees_shared_prompts(impl):
        raise ConfigError("model.attention_impl", SPLASH_SHARED_PROMPTS)
