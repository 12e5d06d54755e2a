"""The multi-turn driver's control flow with a scripted engine (real tokenizer, real envs and tools).

The engine stub only replaces sampling: it answers each request with scripted turn text, encoded by the
tokenizer, so the test knows exactly which tokens were "sampled" and can check token-in/token-out.
The proof with real vLLM generation is tests/envs/test_multiturn_vllm.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rljax.data import make_prompt_renderer
from rljax.envs import EnvSpec, EpisodeLimits, StepResult, generate_multi_turn_groups
from rljax.envs.math_env import TOOL_RESPONSE, ToolMathEnv
from rljax.models.tiny import build_tokenizer
from rljax.rewards.math_verify import math_reward
from rljax.rollout.client import Completion
from rljax.sampling import Sampler, SamplingOptions
from rljax.trajectory import build_loss_inputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


class ScriptedEngine:
    """`generate` returns `script(turn_index)` text per sample, cut at max_tokens ("length")."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts, *, n, max_tokens, stop_token_ids, **sampling):
        self.calls.append({"n": n, "max_tokens": max_tokens, "stop": tuple(stop_token_ids)})
        out = []
        for i, prompt in enumerate(prompts):
            turn = self.tokenizer.decode(prompt, skip_special_tokens=False).count("<tool_response>")
            ids = self.tokenizer(self.script(turn), add_special_tokens=False)["input_ids"]
            finish = "length" if len(ids) > max_tokens else "stop"
            ids = ids[:max_tokens]
            lps = tuple(-0.1 * (k + 1) for k in range(len(ids)))
            out += [Completion(tuple(prompt), tuple(ids), lps, finish, 3, i, j) for j in range(n)]
        return out

    def metrics(self):
        return {}


class MathScorer:
    """The run's reward functions in this process (the `Scorer` protocol): `math` on each item."""

    def score(self, items):
        rewards = np.float32([math_reward(**item) for item in items])
        return rewards, {"math": rewards}, {"reward_fn/calls": float(len(items))}

    def close(self):
        pass


def make_sampler(tokenizer, script, *, max_tokens=16, max_len=512, group_size=2, rewards=None) -> Sampler:
    """A real Sampler over the scripted engine; `rewards` grades final answers (default: `math` here)."""
    options = SamplingOptions(
        group_size=group_size,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=max_tokens,
        stop_token_ids=(tokenizer.eos_token_id,),
        max_sequence_length=max_len,
    )
    renderer = make_prompt_renderer(tokenizer, template="{prompt}", chat_template=False)
    engine = ScriptedEngine(tokenizer, script)
    no_shaping = lambda lengths: np.zeros(len(lengths), np.float32)  # noqa: E731
    return Sampler(tokenizer, engine, renderer, rewards or MathScorer(), no_shaping, options)


EXAMPLES = [{"expr": "3 + 4", "answer": "7"}, {"expr": "6 * 7", "answer": "42"}]
SPEC = EnvSpec(ToolMathEnv)


def answer_script(answers):
    return lambda turn: '"}}</tool_call>' if turn == 0 else f" {answers.pop(0)}<|im_end|>"


def test_token_in_token_out_and_mask(tokenizer):
    sampler = make_sampler(tokenizer, answer_script(["7", "41"]))  # one answer per request
    groups, metrics = generate_multi_turn_groups(sampler, EXAMPLES, seed=0, spec=SPEC)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for g, ex in zip(groups, EXAMPLES, strict=True):
        for t in g.trajectories:
            env = ToolMathEnv()
            assert list(t.prompt_ids) == enc(env.reset(ex))
            call, tool = enc('"}}</tool_call>'), enc(TOOL_RESPONSE.format(output=ex["answer"]))
            answer = list(t.completion_ids[len(call) + len(tool) :])
            assert list(t.completion_ids) == call + tool + answer  # sampled + tool output, nothing else
            assert list(t.completion_mask) == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
            assert answer[-1] == tokenizer.eos_token_id
            assert not t.truncated and t.policy_version == 3
    assert [list(g.rewards) for g in groups] == [[1.0, 1.0], [0.0, 0.0]]
    assert metrics["env/tool_calls"] == 4 and metrics["env/turns_mean"] == 2.0
    assert metrics["env/tool_errors"] == 0 and metrics["env/tool_timeouts"] == 0
    calls = sampler.engine.calls
    assert [c["n"] for c in calls] == [2, 2]  # equal histories share one request (same tool output here)
    assert calls[0]["stop"] == (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</tool_call>"))
    traj = groups[0].trajectories[0]
    batch = build_loss_inputs([traj], np.zeros(1), temperature=1.0)
    p, c = len(traj.prompt_ids), len(traj.completion_ids)
    mask = np.asarray(batch.loss_mask[0])
    np.testing.assert_array_equal(mask[p - 1 : p - 1 + c], traj.completion_mask)
    assert mask.sum() == sum(traj.completion_mask)  # 1 exactly on model-sampled tokens
    np.testing.assert_array_equal(np.asarray(batch.target_ids[0, p - 1 : p - 1 + c]), traj.completion_ids)
    logp = np.asarray(batch.behavior_logp[0, p - 1 : p - 1 + c])
    assert np.all(logp[np.asarray(traj.completion_mask) == 0] == 0)
    n_call = len(enc('"}}</tool_call>'))
    np.testing.assert_allclose(logp[:n_call], [-0.1 * (k + 1) for k in range(n_call)], rtol=1e-6)


def test_max_turns_truncates_and_flags(tokenizer):
    always_call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
    sampler = make_sampler(
        tokenizer, lambda turn: '"}}</tool_call>' if turn == 0 else always_call, max_tokens=64
    )
    spec = EnvSpec(ToolMathEnv, EpisodeLimits(max_turns=3))
    groups, metrics = generate_multi_turn_groups(sampler, EXAMPLES[:1], seed=0, spec=spec)
    t = groups[0].trajectories[0]
    assert t.truncated and metrics["env/truncated_max_turns"] == 2 and metrics["env/turns_mean"] == 3
    assert t.completion_mask[-1] == 1  # the last turn's observation was not appended
    assert metrics["env/tool_calls"] == 6 and list(groups[0].rewards) == [0.0, 0.0]


def test_max_total_tokens_truncates(tokenizer):
    probe = make_sampler(tokenizer, answer_script(["7", "7"]))
    prompt_len = len(tokenizer(ToolMathEnv().reset(EXAMPLES[0]), add_special_tokens=False)["input_ids"])
    # room for the first turn but not for the tool response after it
    sampler = make_sampler(tokenizer, answer_script(["7", "7"]), max_len=prompt_len + 10)
    groups, metrics = generate_multi_turn_groups(sampler, EXAMPLES[:1], seed=0, spec=SPEC)
    assert metrics["env/truncated_max_tokens"] == 2 and metrics["env/tool_output_tokens"] == 0
    assert all(t.truncated and all(m == 1 for m in t.completion_mask) for t in groups[0].trajectories)
    assert probe.options.max_sequence_length == 512
    tight = make_sampler(tokenizer, answer_script([]), max_len=prompt_len + 3)  # the first turn gets 3 tokens
    groups, metrics = generate_multi_turn_groups(tight, EXAMPLES[:1], seed=0, spec=SPEC)
    assert tight.engine.calls[0]["max_tokens"] == 3 and metrics["env/truncated_max_tokens"] == 2
    assert all(len(t.completion_ids) == 3 for t in groups[0].trajectories)


def test_turn_length_limit_ends_episode(tokenizer):
    sampler = make_sampler(tokenizer, lambda turn: " the answer is seven, I think" * 3, max_tokens=5)
    groups, metrics = generate_multi_turn_groups(sampler, EXAMPLES[:1], seed=0, spec=SPEC)
    assert metrics["env/truncated_turn_length"] == 2 and metrics["env/turns_mean"] == 1
    assert all(t.truncated and len(t.completion_ids) == 5 for t in groups[0].trajectories)


class FaultyEnv(ToolMathEnv):
    """Hangs on example "hang", raises on example "boom", behaves otherwise."""

    gate = threading.Event()

    def step(self, action):
        if self._example["expr"] == "hang":
            self.gate.wait(30)
        if self._example["expr"] == "boom":
            raise RuntimeError("env bug")
        return super().step(action)


def test_env_faults_do_not_stall_the_rollout(tokenizer):
    examples = [{"expr": "hang", "answer": "0"}, {"expr": "boom", "answer": "0"}, EXAMPLES[0]]
    sampler = make_sampler(tokenizer, answer_script(["7", "7"]))
    spec = EnvSpec(FaultyEnv, EpisodeLimits(step_timeout_s=0.5))
    try:
        groups, metrics = generate_multi_turn_groups(sampler, examples, seed=0, spec=spec)
    finally:
        FaultyEnv.gate.set()
    assert metrics["env/tool_timeouts"] == 2 and metrics["env/step_errors"] == 2
    assert [list(g.rewards) for g in groups] == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert all(t.truncated for g in groups[:2] for t in g.trajectories)
    assert not any(t.truncated for t in groups[2].trajectories)


def test_malformed_call_gets_an_error_observation(tokenizer):
    retry = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>'
    script = lambda turn: ["}</tool_call>", retry, " 7<|im_end|>"][turn]  # noqa: E731
    sampler = make_sampler(tokenizer, script, group_size=1, max_tokens=64)
    groups, metrics = generate_multi_turn_groups(sampler, EXAMPLES[:1], seed=0, spec=EnvSpec(ToolMathEnv))
    assert metrics["env/malformed_calls"] == 1 and metrics["env/tool_errors"] == 1
    text = tokenizer.decode(list(groups[0].trajectories[0].completion_ids), skip_special_tokens=False)
    assert "malformed tool call" in text and metrics["env/turns_mean"] == 3
    assert list(groups[0].rewards) == [1.0]  # the retried call worked and the answer was right


def test_step_results_are_plain_data():
    assert StepResult("o", 1.0, True).info == {}


def hangs_or_grades(*, prompt, completion, example, **options):
    """A verifier that hangs on the answer "hang" (as a grader stuck in C code would), else `math`."""
    if completion == "hang":
        time.sleep(3600)
    return math_reward(prompt=prompt, completion=completion, example=example)


def test_a_hanging_verdict_is_killed_in_the_reward_pool_not_waited_for(tokenizer):
    """The final answers are graded in the reward pool's worker processes, not in the step's thread: a
    grade that hangs is killed at the pool's timeout (its episodes score the minimum), the others count."""
    from rljax.rewards import RewardPool

    with RewardPool([(hangs_or_grades, 1.0, {})], num_workers=1, timeout_s=1.0) as pool:
        sampler = make_sampler(tokenizer, answer_script(["hang", "42"]), rewards=pool)
        t0 = time.monotonic()
        groups, metrics = generate_multi_turn_groups(sampler, EXAMPLES, seed=0, spec=SPEC)
        elapsed = time.monotonic() - t0
    assert elapsed < 30.0  # two 1 s kills and restarts; a stall would take the full hour
    assert [t.reward for t in groups[0].trajectories] == [0.0, 0.0]  # hung: killed, scored 0
    assert [t.reward for t in groups[1].trajectories] == [1.0, 1.0]  # 42 is 6 * 7
    assert metrics["reward_fn/timeouts"] == 2.0
