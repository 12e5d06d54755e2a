"""Fused log-prob + entropy kernels, installed as `rljax.kernels`.

`token_logprobs(hidden, unembed, targets, ...)` returns per-token log-probs (and entropies) without building
the [tokens, vocab] logits; implementations live in the `IMPLS` registry.
"""

from .api import check_backend, resolve_impl, token_logprobs
from .common import IMPLS

__all__ = ["IMPLS", "check_backend", "resolve_impl", "token_logprobs"]
