"""Rollout and trajectory phases: prompts -> sampled groups with rewards -> one LossInputs batch.

Dynamic sampling (DAPO) drops groups whose rewards all agree and refills them from fresh prompts, up
to `algo.max_refill_rounds` rounds; if still short, the batch is completed with the dropped groups so the
batch shape (and the jit cache) never changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from rljax.config import Config
from rljax.envs import ENVS
from rljax.loop.data_setup import PromptStream
from rljax.metrics import combine_metrics
from rljax.sampling import Sampler, SamplingOptions
from rljax.trajectory import Group, Trajectory, build_loss_inputs
from rljax.types import LossInputs

# `generate(sampler, examples, seed) -> (groups, metrics)`: single-turn below, or an environment's.
GenerateGroups = Callable[[Sampler, list[dict], int], tuple[list[Group], dict]]


@dataclasses.dataclass(frozen=True)
class Collector:
    """Where a step's groups come from (sync mode, and the async producer's work): the prompt stream,
    the generator resolved once from `rollout.env`, and the dynamic-sampling settings."""

    sampler: Sampler
    prompts: PromptStream
    generate: GenerateGroups
    groups_per_step: int  # rollout.batch_size // rollout.group_size
    seed: int  # trainer.seed
    dynamic_sampling: bool
    max_refill_rounds: int


def make_collector(cfg: Config, sampler: Sampler, prompts: PromptStream) -> Collector:
    """The run's Collector; `rollout.env` (empty: single-turn) picks the generator here, once."""
    generate = ENVS.get(cfg.rollout.env).generate_groups if cfg.rollout.env else generate_groups
    return Collector(
        sampler=sampler,
        prompts=prompts,
        generate=generate,
        groups_per_step=cfg.rollout.batch_size // cfg.rollout.group_size,
        seed=cfg.trainer.seed,
        dynamic_sampling=cfg.algo.dynamic_sampling,
        max_refill_rounds=cfg.algo.max_refill_rounds,
    )


def generate_groups(sampler: Sampler, examples: list[dict], seed: int) -> tuple[list[Group], dict]:
    """Samples `group_size` completions per example and scores them. Returns (groups, metrics)."""
    size = sampler.options.group_size
    prompt_ids = [sampler.encode_prompt(ex) for ex in examples]
    completions = sampler.engine.generate(prompt_ids, **sampler.options.request(n=size, seed=seed))
    by_prompt: dict[int, list] = {i: [] for i in range(len(examples))}
    for c in completions:
        by_prompt[c.prompt_index].append(c)
    items, flat = [], []
    for i, ex in enumerate(examples):
        cs = sorted(by_prompt[i], key=lambda c: c.sample_index)
        if len(cs) != size:
            raise RuntimeError(f"rollout returned {len(cs)} samples for prompt {i}, expected {size}")
        for c in cs:
            items.append(
                {"prompt": sampler.prompt_text(ex), "completion": sampler.decode(c.token_ids), "example": ex}
            )
            flat.append((i, c))
    rewards, per_fn, reward_metrics = sampler.rewards.score(items)
    rewards = rewards + sampler.length_shaping([len(c.token_ids) for _, c in flat])
    groups = [Group(ex, [], {}) for ex in examples]
    for (i, c), r in zip(flat, rewards, strict=True):
        groups[i].trajectories.append(
            Trajectory(
                prompt_ids=prompt_ids[i],
                completion_ids=list(c.token_ids),
                logprobs=list(c.logprobs),
                reward=float(r),
                group_id=0,
                policy_version=int(c.policy_version),
                truncated=c.finish_reason == "length",
            )
        )
    for j, g in enumerate(groups):
        sl = slice(j * size, (j + 1) * size)
        g.per_fn = {name: np.asarray(v)[sl] for name, v in per_fn.items()}
    tokens = sum(len(c.token_ids) for _, c in flat)
    return groups, reward_metrics | sampler.engine.metrics() | {"rollout/generated_tokens": float(tokens)}


def select_groups(collector: Collector, step: int) -> tuple[list[Group], dict]:
    """Prompts for `step`, sampled, scored, and (with dynamic sampling) filtered and refilled."""
    c = collector
    need = c.groups_per_step
    kept, dropped, round_metrics, rounds = [], [], [], 0
    seed = c.seed * 1_000_003 + step * 101
    while len(kept) < need:
        examples = c.prompts.next_examples(need - len(kept))
        groups, metrics_round = c.generate(c.sampler, examples, seed + rounds)
        round_metrics.append(metrics_round)
        if not c.dynamic_sampling:
            kept += groups
            break
        for g in groups:
            (kept if np.std(g.rewards) > 0 else dropped).append(g)
        rounds += 1
        if rounds > c.max_refill_rounds:
            break
    kept += dropped[: need - len(kept)]
    metrics = combine_metrics(round_metrics)  # by the schema's reductions: counts add up, rates average
    metrics["rollout/refill_rounds"] = float(max(rounds - 1, 0))
    metrics["reward/frac_zero_std_groups_dropped"] = len(dropped) / max(len(dropped) + len(kept), 1)
    return kept[:need], metrics


def reward_metrics(groups: list[Group]) -> dict:
    rewards = np.stack([g.rewards for g in groups])
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/frac_zero_std_groups": float(np.mean(rewards.std(axis=1) == 0)),
    }
    for name in groups[0].per_fn:
        out[f"reward/{name}/mean"] = float(np.mean([g.per_fn[name].mean() for g in groups]))
    lengths = np.asarray([len(t.completion_ids) for g in groups for t in g.trajectories])
    truncated = np.asarray([t.truncated for g in groups for t in g.trajectories])
    out |= {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clipped_ratio": float(truncated.mean()),
    }
    return out


def staleness_metrics(versions: np.ndarray, current: int) -> dict:
    stale = current - versions
    hist = np.bincount(stale, minlength=1)
    return {
        "staleness/max": float(stale.max()),
        "staleness/mean": float(stale.mean()),
        "staleness/hist": [int(x) for x in hist],
    }


def to_loss_inputs(
    groups: list[Group],
    step: int,
    *,
    advantages: Callable[[np.ndarray, np.ndarray, int], np.ndarray],
    options: SamplingOptions,
    vocab_size: int,
) -> tuple[LossInputs, dict]:
    """(LossInputs, metrics): group ids, `advantages(rewards f32[B], group_ids i32[B], num_groups)` from
    the configured estimator, the batch validated against the sampler's settings and the vocabulary."""
    trajectories = [dataclasses.replace(t, group_id=j) for j, g in enumerate(groups) for t in g.trajectories]
    rewards = np.asarray([t.reward for t in trajectories], np.float32)
    group_ids = np.asarray([t.group_id for t in trajectories], np.int32)
    adv = np.asarray(advantages(rewards, group_ids, len(groups)), np.float32)
    batch = build_loss_inputs(
        trajectories,
        adv,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        max_len=options.max_sequence_length,
        vocab_size=vocab_size,
    )
    metrics = reward_metrics(groups) | {
        "advantages/mean": float(adv.mean()),
        "advantages/std": float(adv.std()),
    }
    metrics |= staleness_metrics(np.asarray(batch.policy_version), step)
    return batch, metrics
