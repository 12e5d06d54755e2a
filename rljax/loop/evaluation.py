"""Held-out evaluation: greedy (or `rollout.eval_temperature`) completions scored by one verifier.

`eval/accuracy` is the fraction of held-out prompts whose completion the `reward.eval_function`
verifier scores >= 0.5 (1 = correct for the math and countdown verifiers).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def make_evaluator(run, examples: list[dict]) -> Callable[[], dict]:
    """`evaluate() -> {"eval/accuracy": float, "eval/length_mean": float}` on `examples`."""
    from rljax.rewards import RewardPool

    cfg = run.cfg
    verifier = RewardPool(
        [(cfg.reward.eval_function, 1.0, {})],
        num_workers=1,
        timeout_s=cfg.reward.timeout_s,
        sandbox=cfg.reward.sandbox_settings(),
    )
    prompt_ids = [run.encode_prompt(ex) for ex in examples]

    def evaluate() -> dict:
        if not examples:
            return {}
        completions = run.engine.generate(
            prompt_ids,
            n=1,
            temperature=cfg.rollout.eval_temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=cfg.rollout.max_tokens,
            stop_token_ids=run.stop_token_ids,
            seed=cfg.trainer.seed,
        )
        completions = sorted(completions, key=lambda c: c.prompt_index)
        items = [
            {"prompt": run.prompt_text(ex), "completion": run.decode(c.token_ids), "example": ex}
            for ex, c in zip(examples, completions, strict=True)
        ]
        scores, _, _ = verifier.score(items)
        lengths = [len(c.token_ids) for c in completions]
        return {"eval/accuracy": float(np.mean(scores >= 0.5)), "eval/length_mean": float(np.mean(lengths))}

    evaluate.close = verifier.close
    return evaluate
