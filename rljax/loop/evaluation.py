"""Held-out evaluation: greedy (or `rollout.eval_temperature`) completions scored by one verifier.

`eval/accuracy` is the fraction of held-out prompts whose completion the `reward.eval_function`
verifier scores >= 0.5 (1 = correct for the math and countdown verifiers).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def eval_enabled(cfg) -> bool:
    """Whether the run evaluates at all: `trainer.eval_every` 0 or `data.eval_size` 0 switch it off (no
    eval before step 1 either; with `data.eval_size` 0 no prompt is held out of training)."""
    return cfg.trainer.eval_every > 0 and cfg.data.eval_size > 0


def eval_due(cfg, version: int) -> bool:
    """Whether the policy of `version` is evaluated: 0 (before step 1), every `trainer.eval_every`
    versions, and the last, when evaluation is enabled."""
    every = cfg.trainer.eval_every
    return eval_enabled(cfg) and (version % every == 0 or version == cfg.trainer.steps)


def _no_eval() -> dict:
    return {}


_no_eval.close = lambda: None


def make_evaluator(run, examples: list[dict]) -> Callable[[], dict]:
    """`evaluate() -> {"eval/accuracy": float, "eval/length_mean": float}` on `examples`; with evaluation
    off (`eval_enabled`) or no examples, `{}` and no verifier is started."""
    from rljax.rewards import RewardPool

    cfg = run.cfg
    if not examples or not eval_enabled(cfg):
        return _no_eval
    verifier = RewardPool(
        [(cfg.reward.eval_function, 1.0, {})],
        num_workers=1,
        timeout_s=cfg.reward.timeout_s,
        sandbox=cfg.reward.sandbox_settings(),
    )
    prompt_ids = [run.encode_prompt(ex) for ex in examples]

    def evaluate() -> dict:
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
