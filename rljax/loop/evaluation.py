"""Held-out evaluation: greedy (or `rollout.eval_temperature`) completions scored by one verifier.

`eval/accuracy` is the fraction of held-out prompts whose completion the `reward.eval_function`
verifier scores >= 0.5 (1 = correct for the math and countdown verifiers).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rljax.config import Config
from rljax.sampling import Sampler, Scorer


def eval_enabled(cfg: Config) -> bool:
    """Whether the run evaluates at all: `trainer.eval_every` 0 or `data.eval_size` 0 switch it off (no
    eval before step 1 either; with `data.eval_size` 0 no prompt is held out of training)."""
    return cfg.trainer.eval_every > 0 and cfg.data.eval_size > 0


def eval_due(cfg: Config, version: int) -> bool:
    """Whether the policy of `version` is evaluated: 0 (before step 1), every `trainer.eval_every`
    versions, and the last, when evaluation is enabled."""
    every = cfg.trainer.eval_every
    return eval_enabled(cfg) and (version % every == 0 or version == cfg.trainer.steps)


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """`evaluator() -> {"eval/accuracy": float, "eval/length_mean": float}` on held-out prompts;
    `{}` when `verifier` is None (evaluation off). Built once by `make_evaluator`."""

    sampler: Sampler | None
    examples: list[dict]
    prompt_ids: list[list[int]]
    verifier: Scorer | None
    temperature: float  # rollout.eval_temperature
    max_tokens: int
    seed: int

    def __call__(self) -> dict:
        if self.verifier is None:
            return {}
        s = self.sampler
        completions = s.engine.generate(
            self.prompt_ids,
            n=1,
            temperature=self.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=self.max_tokens,
            stop_token_ids=s.options.stop_token_ids,
            seed=self.seed,
        )
        completions = sorted(completions, key=lambda c: c.prompt_index)
        items = [
            {"prompt": s.prompt_text(ex), "completion": s.decode(c.token_ids), "example": ex}
            for ex, c in zip(self.examples, completions, strict=True)
        ]
        scores, _, _ = self.verifier.score(items)
        lengths = [len(c.token_ids) for c in completions]
        return {"eval/accuracy": float(np.mean(scores >= 0.5)), "eval/length_mean": float(np.mean(lengths))}

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()


NO_EVAL = Evaluator(None, [], [], None, 0.0, 0, 0)  # processes other than the leader; evaluation off


def make_evaluator(cfg: Config, sampler: Sampler, examples: list[dict]) -> Evaluator:
    """The run's Evaluator on `examples`; with evaluation off (`eval_enabled`) or no examples, `NO_EVAL`
    and no verifier is started."""
    from rljax.rewards import RewardPool

    if not examples or not eval_enabled(cfg):
        return NO_EVAL
    verifier = RewardPool(
        [cfg.reward.eval_spec()],
        num_workers=1,
        timeout_s=cfg.reward.timeout_s,
        sandbox=cfg.reward.sandbox_settings(),
    )
    return Evaluator(
        sampler=sampler,
        examples=examples,
        prompt_ids=[sampler.encode_prompt(ex) for ex in examples],
        verifier=verifier,
        temperature=cfg.rollout.eval_temperature,
        max_tokens=cfg.rollout.max_tokens,
        seed=cfg.trainer.seed,
    )
