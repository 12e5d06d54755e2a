"""Multi-turn rollouts, token in / token out: `generate_multi_turn_groups(sampler, examples, seed, spec=)`.

Same contract as `rljax.loop.rollout_phase.generate_groups` (groups of `rollout.group_size` scored
trajectories + metrics), but each sample is an episode of an environment (`rljax.envs.base`):

1. `env.reset(example)` gives the prompt text, tokenized once: `prompt_ids`.
2. Each model turn is sampled by `sampler.engine.generate` on the episode's full token history (prompt +
   everything appended so far), stopping at `</tool_call>` or the sampler's stop tokens. Its token ids and
   log-probs are appended as they came back (mask 1).
3. The turn, decoded with special tokens kept, goes to `env.step` (in a daemon thread with a deadline).
   Unless the episode is done, the observation text is tokenized once and its ids appended (mask 0,
   log-prob 0). Nothing already in the history is ever decoded and re-encoded, so the trained tokens are
   exactly the sampled ones plus the inserted ones.

Limits (`EpisodeLimits`) and what happens at each (the trajectory is kept, `truncated` is set, and the
reward is whatever the environment gave so far):
- max_turns model turns: an episode still going after its last turn ends (env/truncated_max_turns);
  the last observation is not appended.
- max_total_tokens (prompt + completion; 0 means the sampler's max_sequence_length): a turn may sample
  only what is left, and an observation that leaves no room for another turn is not appended
  (env/truncated_max_tokens).
- a turn cut by rollout.max_tokens: the episode ends after the env scores it (env/truncated_turn_length).
- step_timeout_s around `env.step` (tools have their own, shorter, deadlines): a step that hangs or
  raises ends its episode (env/tool_timeouts, env/step_errors); other episodes carry on.
Rewards are the sum of the environment's step rewards, plus the run's reward functions (`reward.functions`)
on the final answer an environment hands over (`StepResult.grade`), scored in one batch by the reward
pool's worker processes once every episode ended (a grader that hangs is killed at `reward.timeout_s`
and scores its range's minimum; an episode without a final answer gets 0 from them), plus the sampler's
length shaping on the sampled token count.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from rljax.envs.base import Environment, StepResult, StepTimeout, submit_in_thread
from rljax.envs.parsing import CLOSE
from rljax.registry import Registry
from rljax.sampling import Completion, Sampler
from rljax.trajectory import Group, Trajectory

_STATUS_COUNTS = {
    "ok": ("tool_calls",),
    "error": ("tool_calls", "tool_errors"),
    "timeout": ("tool_calls", "tool_timeouts"),
    "malformed": ("tool_calls", "tool_errors", "malformed_calls"),
}
COUNTERS = (
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "malformed_calls",
    "step_errors",
    "truncated_max_turns",
    "truncated_max_tokens",
    "truncated_turn_length",
    "tool_output_tokens",
)
_TURN_SEED_STRIDE = 1_000_003  # turn t samples with seed + t * stride: distinct streams per turn


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # model turns per episode
    max_total_tokens: int = 0  # prompt + completion tokens; 0 = the sampler's max_sequence_length
    step_timeout_s: float = 30.0  # backstop around env.step
    max_parallel_steps: int = 8  # env steps in flight at once (sandboxes share a process limit)


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """A registered environment: a factory for fresh episodes and the episode limits."""

    make_env: Callable[[], Environment]
    limits: EpisodeLimits = EpisodeLimits()

    def generate_groups(self, sampler: Sampler, examples: list[dict], seed: int) -> tuple[list, dict]:
        """`rollout_phase.generate_groups`'s contract, with episodes of this environment."""
        return generate_multi_turn_groups(sampler, examples, seed, spec=self)


ENVS: Registry[EnvSpec] = Registry("environment")


@dataclasses.dataclass
class Episode:
    """One sample's token history: `completion_ids`, `mask` (1 sampled, 0 inserted) and `logprobs`
    are aligned lists, all i32/f32[C]."""

    env: Environment
    example_index: int
    prompt_ids: list[int]
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    grade: str | None = None  # the final answer's text, scored by the reward pool after the episodes
    prompt: str = ""  # the first observation (`env.reset`), what the reward functions see as the prompt
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def append(self, ids, logprobs, sampled: bool) -> None:
        self.completion_ids += [int(t) for t in ids]
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if sampled else [0.0] * len(ids)

    def end(self, flag: str | None = None) -> None:
        self.done = True
        if flag is not None:
            self.truncated = True
            self.counts[flag] += 1


def turn_stop_ids(sampler: Sampler) -> tuple[int, ...]:
    """The sampler's stop tokens plus `</tool_call>`, which must be one token of the vocabulary."""
    ids = sampler.encode_text(CLOSE)
    if len(ids) != 1:
        raise ValueError(
            f"multi-turn rollouts need {CLOSE!r} as a single (special) token; it encodes as {ids}"
        )
    return tuple(dict.fromkeys((*sampler.options.stop_token_ids, int(ids[0]))))


def start_episodes(sampler: Sampler, examples: list[dict], spec: EnvSpec) -> list[Episode]:
    """`group_size` fresh episodes per example, example-major; each prompt tokenized once."""
    episodes = []
    for i, example in enumerate(examples):
        for _ in range(sampler.options.group_size):
            env = spec.make_env()
            prompt = env.reset(example)
            episodes.append(Episode(env, i, sampler.encode_text(prompt), prompt=prompt))
    return episodes


def sample_turn(sampler: Sampler, episodes: list[Episode], seed: int, max_total: int) -> list[Completion]:
    """One completion per episode (aligned with `episodes`). Episodes with equal histories (the first
    turn of a group) share one request with n samples; one engine call per (budget, n)."""
    ro = sampler.options
    histories: dict[tuple, list[int]] = collections.defaultdict(list)
    for j, e in enumerate(episodes):
        histories[tuple(e.prompt_ids + e.completion_ids)].append(j)
    calls: dict[tuple[int, int], list[tuple]] = collections.defaultdict(list)
    for history, members in histories.items():
        budget = min(ro.max_tokens, max_total - len(history))
        calls[(budget, len(members))].append(history)
    out: list[Completion | None] = [None] * len(episodes)
    stop = turn_stop_ids(sampler)
    for (budget, n), prompts in sorted(calls.items()):
        request = ro.request(n=n, seed=seed, max_tokens=budget, stop_token_ids=stop)
        completions = sampler.engine.generate([list(h) for h in prompts], **request)
        for c in completions:
            out[histories[prompts[c.prompt_index]][c.sample_index]] = c
    if any(c is None for c in out):
        raise RuntimeError("rollout engine returned fewer completions than requested")
    return out


def step_all(envs: list[Environment], actions: list[str], limits: EpisodeLimits) -> list[Any]:
    """`env.step(action)` for each pair, `max_parallel_steps` at a time, each with the step deadline.
    Returns a StepResult, or the exception (StepTimeout included) that step raised, per pair."""
    results: list[Any] = []
    for lo in range(0, len(envs), limits.max_parallel_steps):
        chunk = range(lo, min(lo + limits.max_parallel_steps, len(envs)))
        futures = [submit_in_thread(envs[k].step, actions[k]) for k in chunk]
        for f in futures:  # all started together, so waiting for each in turn bounds the chunk
            try:
                results.append(f.result(timeout=limits.step_timeout_s))
            except TimeoutError:
                results.append(StepTimeout(f"env step exceeded {limits.step_timeout_s} s"))
            except Exception as e:  # noqa: BLE001  (an env bug ends one episode, not the rollout)
                results.append(e)
    return results


def apply_step(sampler: Sampler, ep: Episode, result: Any, *, last_turn: bool, max_total: int) -> None:
    """Records one env step: reward, tool counters, and the observation unless the episode ends."""
    if isinstance(result, StepTimeout):
        return ep.end("tool_timeouts")
    if not isinstance(result, StepResult):
        return ep.end("step_errors")
    ep.reward += float(result.reward)
    if result.grade is not None:
        ep.grade = result.grade
    for name in _STATUS_COUNTS.get(result.info.get("tool_status"), ()):
        ep.counts[name] += 1
    if result.done or ep.done:
        return ep.end()
    if last_turn:
        return ep.end("truncated_max_turns")
    ids = sampler.encode_text(result.observation)
    if ep.length + len(ids) >= max_total:  # no room left for another model turn
        return ep.end("truncated_max_tokens")
    ep.append(ids, (), sampled=False)
    ep.counts["tool_output_tokens"] += len(ids)


def record_turn(ep: Episode, completion, *, budget_is_total: bool) -> None:
    """Appends a sampled turn (mask 1). A turn cut by its token budget ends the episode once scored;
    `budget_is_total` says the budget was what was left of max_total_tokens, not rollout.max_tokens."""
    ep.append(completion.token_ids, completion.logprobs, sampled=True)
    ep.versions.append(int(completion.policy_version))
    ep.turns += 1
    if completion.finish_reason == "length":
        ep.truncated = ep.done = True  # apply_step still adds the env's reward for this turn
        ep.counts["truncated_max_tokens" if budget_is_total else "truncated_turn_length"] += 1


def run_episodes(sampler: Sampler, episodes: list[Episode], seed: int, limits: EpisodeLimits) -> None:
    """Plays every episode to its end (see the module docstring for the limits)."""
    max_len = sampler.options.max_sequence_length
    max_total = min(limits.max_total_tokens or max_len, max_len)
    for turn in range(limits.max_turns):
        active = [e for e in episodes if not e.done]
        for e in active:
            if e.length >= max_total:
                e.end("truncated_max_tokens")
        active = [e for e in active if not e.done]
        if not active:
            return
        completions = sample_turn(sampler, active, seed + turn * _TURN_SEED_STRIDE, max_total)
        for e, c in zip(active, completions, strict=True):
            record_turn(e, c, budget_is_total=max_total - e.length < sampler.options.max_tokens)
        decoded = [sampler.decode(c.token_ids, skip_special_tokens=False) for c in completions]
        results = step_all([e.env for e in active], decoded, limits)
        for e, r in zip(active, results, strict=True):
            apply_step(sampler, e, r, last_turn=turn + 1 == limits.max_turns, max_total=max_total)


def to_trajectory(ep: Episode, reward: float) -> Trajectory:
    """The episode as the trainer sees it; policy_version is the oldest of its turns'."""
    return Trajectory(
        prompt_ids=ep.prompt_ids,
        completion_ids=ep.completion_ids,
        logprobs=ep.logprobs,
        reward=float(reward),
        group_id=0,
        policy_version=min(ep.versions),
        truncated=ep.truncated,
        completion_mask=ep.mask,
    )


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """env/turns_mean and env/<counter> totals (tool_calls, tool_errors, tool_timeouts, ...)."""
    totals = sum((e.counts for e in episodes), collections.Counter())
    out = {f"env/{name}": float(totals[name]) for name in COUNTERS}
    out["env/turns_mean"] = float(np.mean([e.turns for e in episodes]))
    out["env/truncated_frac"] = float(np.mean([e.truncated for e in episodes]))
    out["rollout/generated_tokens"] = float(sum(sum(e.mask) for e in episodes))
    return out


def grade_episodes(
    sampler: Sampler, examples: list[dict], episodes: list[Episode]
) -> tuple[np.ndarray, dict, dict]:
    """The run's reward functions on each episode's final answer, in the reward pool (one batch): (f32[N]
    rewards, zeros where an episode handed none; per-function f32[N]; the pool's metrics)."""
    graded = [k for k, e in enumerate(episodes) if e.grade is not None]
    total = np.zeros(len(episodes), np.float32)
    if not graded:
        return total, {}, {}
    items = [
        {"prompt": e.prompt, "completion": e.grade, "example": examples[e.example_index]}
        for e in (episodes[k] for k in graded)
    ]
    rewards, per_fn, metrics = sampler.rewards.score(items)
    total[graded] = rewards
    full = {name: np.zeros(len(episodes), np.float32) for name in per_fn}
    for name, values in per_fn.items():
        full[name][graded] = values
    return total, full, metrics


def generate_multi_turn_groups(
    sampler: Sampler, examples: list[dict], seed: int, *, spec: EnvSpec
) -> tuple[list[Group], dict]:
    """Plays `group_size` episodes of `spec`'s environment per example; returns (groups, metrics) like
    `rollout_phase.generate_groups`."""
    episodes = start_episodes(sampler, examples, spec)
    run_episodes(sampler, episodes, seed, spec.limits)
    verdict, per_fn, grade_metrics = grade_episodes(sampler, examples, episodes)
    env_rewards = np.asarray([e.reward for e in episodes], np.float32) + verdict
    rewards = env_rewards + sampler.length_shaping([sum(e.mask) for e in episodes])
    groups = [Group(ex, [], {}) for ex in examples]
    for e, r in zip(episodes, rewards, strict=True):
        groups[e.example_index].trajectories.append(to_trajectory(e, r))
    size = sampler.options.group_size
    for j, g in enumerate(groups):
        window = slice(j * size, (j + 1) * size)
        g.per_fn = {"env": env_rewards[window]} | {name: v[window] for name, v in per_fn.items()}
    return groups, episode_metrics(episodes) | grade_metrics | sampler.engine.metrics()
