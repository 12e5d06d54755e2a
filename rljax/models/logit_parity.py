"""rljax's float32 logits against transformers' on a checkpoint directory: the check every conversion of
`rljax.models.fetch` must pass before it is kept (`ParityCheck`, `logit_parity`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

# The issue's bound on max |rljax - transformers| float32 logits. It sits at float32's rounding floor for a
# 30-layer model with logits up to ~38 (smollm2: 1.1e-4; transformers' own float32 logits are 9.3e-5 from
# its float64 ones), so above it `ParityCheck` tells rounding from a mismatch against float64 logits.
TOLERANCE = 1e-4
# rljax's float32 logits may be this many times further from the float64 ones than transformers' float32
# logits are (smollm2: 1.16x blockwise, 1.3x materialized); a real mismatch (a permuted head, a wrong RoPE
# base or norm eps) is orders of magnitude above float32 rounding.
ROUNDING_FACTOR = 2.0
CHECK_MESSAGES = ({"role": "user", "content": "What is the capital of France? Answer in one word."},)


@dataclasses.dataclass(frozen=True)
class ParityCheck:
    """rljax's float32 logits vs transformers' on one chat prompt, max abs over `[1, T, V]`.

    `max_abs_diff` (rljax float32 vs transformers float32) is the figure the check is named by; within
    `TOLERANCE` it passes. Above it, both float32 results are measured against transformers in float64
    (the same weights, exact to float32's eyes): float32 rounding alone passes (rljax no further from the
    exact logits than `ROUNDING_FACTOR` times transformers' own float32 result), a real mismatch fails.
    """

    max_abs_diff: float
    rljax_vs_float64: float | None = None  # measured only when max_abs_diff > TOLERANCE
    transformers_vs_float64: float | None = None

    @property
    def passed(self) -> bool:
        if self.max_abs_diff <= TOLERANCE:
            return True
        if self.rljax_vs_float64 is None or self.transformers_vs_float64 is None:
            return False
        return self.rljax_vs_float64 <= ROUNDING_FACTOR * self.transformers_vs_float64

    def describe(self) -> str:
        text = f"max |logit diff| vs transformers {self.max_abs_diff:.3g} (float32, tolerance {TOLERANCE:g})"
        if self.rljax_vs_float64 is not None:
            text += (
                f"; vs float64 logits: rljax {self.rljax_vs_float64:.3g}, transformers "
                f"{self.transformers_vs_float64:.3g} (float32 rounding passes up to {ROUNDING_FACTOR:g}x)"
            )
        return text


def logit_parity(path: Path, messages: Sequence[dict] = CHECK_MESSAGES) -> ParityCheck:
    """`ParityCheck` of the checkpoint directory `path` on the chat prompt `messages` (rendered by the
    checkpoint's own chat template). rljax runs `forward` with the config as loaded
    (`attention_impl="auto"`, as the HF parity tests do)."""
    import numpy as np
    import torch
    import transformers

    from rljax.models.hf import load_hf_checkpoint, load_tokenizer
    from rljax.models.model import forward

    tokenizer = load_tokenizer(path)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]], np.int32)
    config, params = load_hf_checkpoint(path, dtype="float32")
    ours = np.asarray(forward(config, params, ids), np.float64)
    del params
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.as_tensor(ids, dtype=torch.long)).logits.numpy().astype(np.float64)
        diff = float(np.abs(ours - theirs).max())
        if diff <= TOLERANCE:
            return ParityCheck(diff)
        exact = ref.double()(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    return ParityCheck(diff, float(np.abs(ours - exact).max()), float(np.abs(theirs - exact).max()))
