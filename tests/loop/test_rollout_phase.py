"""Dynamic sampling in `select_groups` (control flow only: the Collector's generator is a fake, scoring is
not needed):
zero-std groups are dropped and refilled from fresh prompts, metrics of the rounds combine by the schema
(counts add up, rates average), and the batch is completed with dropped groups when refills run out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from mp_trainer_common import with_fields

from rljax.config import Config
from rljax.loop import rollout_phase
from rljax.loop.rollout_phase import Collector, make_collector
from rljax.trajectory import Group, Trajectory


class Prompts:
    def __init__(self):
        self.served = 0

    def next_examples(self, n):
        out = [{"id": self.served + i} for i in range(n)]
        self.served += n
        return out


def collector(generate, **changes) -> Collector:
    """The run's Collector for these settings (`make_collector`), with a fake generator; the sampler
    is never touched by `select_groups` itself (only handed to the generator)."""
    cfg = with_fields(Config(), rollout__batch_size=8, rollout__group_size=2, **changes)
    real = make_collector(cfg, sampler=None, prompts=Prompts())
    assert real.generate is rollout_phase.generate_groups  # rollout.env "" -> single-turn
    return dataclasses.replace(real, generate=generate)


def fake_generate(rewards_of):
    """Groups whose two rewards are `rewards_of(example_id)`; per round: 1 timeout, 10 tokens, 100 tok/s."""
    calls = []

    def generate(sampler, examples, seed):
        calls.append((len(examples), seed))
        groups = [Group(ex, [], {}) for ex in examples]
        for g in groups:
            g.trajectories = [Trajectory([1], [2], [-1.0], r, 0, 0) for r in rewards_of(g.example["id"])]
        metrics = {
            "reward_fn/timeouts": 1.0,
            "rollout/generated_tokens": 10.0,
            "rollout/tokens_per_s": 100.0 * len(calls),
        }
        return groups, metrics

    return generate, calls


def test_dynamic_sampling_refills_and_combines_round_metrics():
    # Even ids have rewards that agree (std 0: dropped); odd ids are informative.
    generate, calls = fake_generate(lambda i: (1.0, 1.0) if i % 2 == 0 else (0.0, 1.0))
    source = collector(generate, algo__dynamic_sampling=True, algo__max_refill_rounds=5)
    groups, metrics = rollout_phase.select_groups(source, step=3)
    assert [g.example["id"] for g in groups] == [1, 3, 5, 7]
    assert [n for n, _ in calls] == [4, 2, 1, 1]  # each round asks for the groups still missing
    seeds = [s for _, s in calls]
    assert seeds == list(range(seeds[0], seeds[0] + 4))  # a fresh seed per round
    assert metrics["reward_fn/timeouts"] == 4.0 and metrics["rollout/generated_tokens"] == 40.0
    assert metrics["rollout/tokens_per_s"] == pytest.approx(250.0)  # a rate: the mean of 100..400
    assert metrics["rollout/refill_rounds"] == 3.0
    assert metrics["reward/frac_zero_std_groups_dropped"] == pytest.approx(4 / 8)


def test_refills_exhausted_complete_the_batch_with_dropped_groups():
    generate, calls = fake_generate(lambda i: (1.0, 1.0))  # every group is uninformative
    source = collector(generate, algo__dynamic_sampling=True, algo__max_refill_rounds=2)
    groups, metrics = rollout_phase.select_groups(source, step=0)
    assert len(groups) == 4 and len(calls) == 3  # the first round + 2 refills, then give up
    assert np.all([np.std(g.rewards) == 0 for g in groups])  # shape kept: dropped groups fill it
    assert metrics["rollout/refill_rounds"] == 2.0


def test_without_dynamic_sampling_one_round():
    generate, calls = fake_generate(lambda i: (1.0, 1.0))
    groups, metrics = rollout_phase.select_groups(collector(generate), step=0)
    assert len(groups) == 4 and len(calls) == 1 and metrics["reward_fn/timeouts"] == 1.0
