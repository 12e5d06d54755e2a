"""Rollout and trajectory phases: prompts -> sampled groups with rewards -> one LossInputs batch.

Dynamic sampling (DAPO) drops groups whose rewards all agree and refills them from fresh prompts, up
to `algo.max_refill_rounds` rounds; if still short, the batch is completed with the dropped groups so the
batch shape (and the jit cache) never changes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rljax.envs import ENVS
from rljax.metrics import combine_metrics
from rljax.trajectory import Group, Trajectory, build_loss_inputs


def generate_groups(run, examples: list[dict], seed: int) -> tuple[list[Group], dict]:
    """Samples `rollout.group_size` completions per example and scores them. Returns (groups, metrics)."""
    ro = run.cfg.rollout
    prompt_ids = [run.encode_prompt(ex) for ex in examples]
    completions = run.engine.generate(
        prompt_ids,
        n=ro.group_size,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        max_tokens=ro.max_tokens,
        stop_token_ids=run.stop_token_ids,
        seed=seed,
    )
    by_prompt: dict[int, list] = {i: [] for i in range(len(examples))}
    for c in completions:
        by_prompt[c.prompt_index].append(c)
    items, flat = [], []
    for i, ex in enumerate(examples):
        cs = sorted(by_prompt[i], key=lambda c: c.sample_index)
        if len(cs) != ro.group_size:
            raise RuntimeError(f"rollout returned {len(cs)} samples for prompt {i}, expected {ro.group_size}")
        for c in cs:
            items.append(
                {"prompt": run.prompt_text(ex), "completion": run.decode(c.token_ids), "example": ex}
            )
            flat.append((i, c))
    rewards, per_fn, reward_metrics = run.rewards.score(items)
    rewards = rewards + run.length_shaping([len(c.token_ids) for _, c in flat])
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
        sl = slice(j * ro.group_size, (j + 1) * ro.group_size)
        g.per_fn = {name: np.asarray(v)[sl] for name, v in per_fn.items()}
    tokens = sum(len(c.token_ids) for _, c in flat)
    return groups, reward_metrics | run.engine.metrics() | {"rollout/generated_tokens": float(tokens)}


def select_groups(run, step: int) -> tuple[list[Group], dict]:
    """Sync mode: prompts for `step`, sampled, scored, and (with dynamic sampling) filtered and refilled."""
    cfg = run.cfg
    need = cfg.rollout.batch_size // cfg.rollout.group_size
    kept, dropped, round_metrics, rounds = [], [], [], 0
    seed = cfg.trainer.seed * 1_000_003 + step * 101
    generate = ENVS.get(cfg.rollout.env).generate_groups if cfg.rollout.env else generate_groups
    while len(kept) < need:
        groups, metrics_round = generate(run, run.prompts.next_examples(need - len(kept)), seed + rounds)
        round_metrics.append(metrics_round)
        if not cfg.algo.dynamic_sampling:
            kept += groups
            break
        for g in groups:
            (kept if np.std(g.rewards) > 0 else dropped).append(g)
        rounds += 1
        if rounds > cfg.algo.max_refill_rounds:
            break
    kept += dropped[: need - len(kept)]
    metrics = combine_metrics(round_metrics)  # by the schema's reductions: counts add up, rates average
    metrics["rollout/refill_rounds"] = float(max(rounds - 1, 0))
    metrics["reward/frac_zero_std_groups_dropped"] = len(dropped) / max(len(dropped) + len(kept), 1)
    return kept[:need], metrics


def collect(run, step: int) -> tuple[list[Group], dict]:
    """The groups trained on at `step`: generated now (sync) or taken from the async buffer."""
    if run.producer is not None:
        return run.producer.take(step)
    return select_groups(run, step)


def reward_metrics(run, groups: list[Group]) -> dict:
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


def to_loss_inputs(run, groups: list[Group], step: int):
    """(LossInputs, metrics): group ids, advantages from the configured estimator, validated batch."""
    ro = run.cfg.rollout
    trajectories = [dataclasses.replace(t, group_id=j) for j, g in enumerate(groups) for t in g.trajectories]
    rewards = np.asarray([t.reward for t in trajectories], np.float32)
    group_ids = np.asarray([t.group_id for t in trajectories], np.int32)
    advantages = np.asarray(run.advantages(rewards, group_ids, len(groups)), np.float32)
    batch = build_loss_inputs(
        trajectories,
        advantages,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        max_len=run.max_sequence_length,
        vocab_size=run.model_config.vocab_size,
    )
    metrics = reward_metrics(run, groups) | {
        "advantages/mean": float(advantages.mean()),
        "advantages/std": float(advantages.std()),
    }
    metrics |= staleness_metrics(np.asarray(batch.policy_version), step)
    return batch, metrics
