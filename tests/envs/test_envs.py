"""Tools, tool-call parsing, timeouts and the math environment (no model, no vLLM)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rljax.envs import (
    ENVS,
    MalformedCall,
    StepResult,
    StepTimeout,
    ToolCall,
    ToolError,
    astep,
    calculate,
    call_with_timeout,
    format_tool_call,
    parse_tool_call,
    run_tool,
)
from rljax.envs import tools as tools_mod
from rljax.envs.math_env import TOOL_RESPONSE, ToolMathEnv, answer_text


@pytest.mark.parametrize(
    "expr, value",
    [
        ("2 * (3 + 4) ** 2", 98),  # precedence and parentheses, worked by hand: 2 * 49
        ("7 - -3", 10),
        ("17 // 5 + 17 % 5", 5),  # 3 + 2
        ("1 / 4", 0.25),
        ("2 ** -2", 0.25),
    ],
)
def test_calculator_golden(expr, value):
    assert calculate(expr) == value


def test_calculator_formats_numbers():
    assert tools_mod.calculator_tool({"expression": "6 / 3"}) == "2"
    assert tools_mod.calculator_tool({"expression": "1 / 3"}) == "0.333333333333"
    assert tools_mod.calculator_tool({"expression": "713 * 58 + 9"}) == "41363"


@pytest.mark.parametrize(
    "expr, message",
    [
        ("__import__('os').system('true')", "unsupported syntax: Call"),
        ("x + 1", "unsupported syntax: Name"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent 387420489 exceeds 64"),  # ** is right-associative: 9 ** (9 ** 9)
        ("(2 ** 64) ** 64 * (2 ** 64) ** 64", "result too large"),
        ("(-8) ** 0.5", "complex"),
        ("1 +", "syntax error"),
        ("1" * 300, "longer than"),
        ("True + 1", "unsupported syntax: Constant"),
    ],
)
def test_calculator_refuses(expr, message):
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace("*", r"\*")):
        calculate(expr)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("the answer is 7", None),
        (
            'x <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
            ToolCall("calculator", {"expression": "1+2"}),
        ),
        (  # Hermes sometimes JSON-encodes the arguments
            '<tool_call> {"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"} </tool_call>',
            ToolCall("calculator", {"expression": "3"}),
        ),
        ('<tool_call>{"name": "python"}</tool_call>', ToolCall("python", {})),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1', "without"),
        ("<tool_call>{'name': 'calculator'}</tool_call>", "invalid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object, got list"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "c", "arguments": "nope"}</tool_call>', "not JSON"),
    ],
)
def test_parse_tool_call(text, expected):
    got = parse_tool_call(text)
    if isinstance(expected, str):
        assert isinstance(got, MalformedCall) and expected in got.reason, got
    else:
        assert got == expected


def test_format_then_parse_round_trips():
    call = ToolCall("calculator", {"expression": "2 + 2"})
    assert parse_tool_call(format_tool_call(call.name, call.arguments)) == call


@pytest.mark.parametrize(
    "body,reason",
    [  # the policy's text, parsed in the trainer: refused as malformed, in bounded time, never raised
        ("[" * 10_000, "invalid JSON: RecursionError"),
        (
            '{"name": "calculator", "arguments": {"expression": 1' + "0" * 5000 + "}}",
            "invalid JSON: ValueError",
        ),
        ('{"name": "x", "arguments": "' + "[" * 10_000 + '"}', "arguments is a string but not JSON"),
        ('{"name": "x", "arguments": "' + "9" * 5000 + '"}', "arguments is a string but not JSON"),
        ("[" + "1," * 3_000_000 + "1]", "longer than 16384 characters"),
    ],
    ids=["deep", "digits", "deep-arguments", "digits-arguments", "huge"],
)
def test_adversarial_tool_calls_are_malformed_not_exceptions(body, reason):
    import time

    t0 = time.perf_counter()
    got = parse_tool_call(f"<tool_call>{body}</tool_call>")
    assert isinstance(got, MalformedCall) and reason in got.reason, got
    assert time.perf_counter() - t0 < 0.5


def test_run_tool_turns_faults_into_outcomes(monkeypatch):
    release = threading.Event()

    def hang(arguments):
        release.wait(30)
        return "late"

    def boom(arguments):
        raise RuntimeError("kaput")

    monkeypatch.setitem(tools_mod.TOOLS._entries, "hang", hang)
    monkeypatch.setitem(tools_mod.TOOLS._entries, "boom", boom)
    monkeypatch.setitem(tools_mod.TOOLS._entries, "number", lambda arguments: 3)
    try:
        assert run_tool("hang", {}, timeout_s=0.2).status == "timeout"
    finally:
        release.set()
    boom_outcome = run_tool("boom", {}, timeout_s=5)
    assert (boom_outcome.status, boom_outcome.text) == ("error", "error: RuntimeError: kaput")
    assert run_tool("number", {}, timeout_s=5).status == "error"  # a non-text result is an error
    unknown = run_tool("nope", {}, timeout_s=5)
    assert unknown.status == "error" and "available: " in unknown.text and "calculator" in unknown.text
    bad_args = run_tool("calculator", {"expr": "1"}, timeout_s=5)
    assert bad_args.status == "error" and '"expression"' in bad_args.text
    assert run_tool("calculator", {"expression": "6 * 7"}, timeout_s=5).text == "42"


def test_python_tool_runs_in_the_sandbox():
    ok = run_tool("python", {"code": "print(sum(range(10)))"}, timeout_s=20)
    assert (ok.status, ok.text) == ("ok", "45")
    failed = run_tool("python", {"code": "raise ValueError('bad input')"}, timeout_s=20)
    assert failed.status == "error" and "ValueError: bad input" in failed.text
    slow = tools_mod.python_tool  # the sandbox's own limit fires first and kills the process
    with pytest.raises(StepTimeout):
        slow({"code": "while True: pass"}, timeout_s=0.5)


def test_call_with_timeout_and_astep():
    assert call_with_timeout(lambda a, b: a + b, 2, 3, timeout_s=5) == 5
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["x"], timeout_s=5)
    gate = threading.Event()

    class Hung:
        def step(self, action):
            gate.wait(30)
            return StepResult("", 0.0, True)

    class Quick:
        def step(self, action):
            return StepResult(action.upper(), 1.0, False)

    async def both():
        quick = await astep(Quick(), "ok", timeout_s=5)
        with pytest.raises(StepTimeout):
            await astep(Hung(), "x", timeout_s=0.2)
        return quick

    try:
        assert asyncio.run(both()) == StepResult("OK", 1.0, False)
    finally:
        gate.set()


EXAMPLE = {"expr": "3 + 4", "answer": "7"}


def test_math_env_episode_with_prefilled_call():
    env = ToolMathEnv()
    prompt = env.reset(EXAMPLE)
    assert prompt.endswith('<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4')
    first = env.step('"}}</tool_call>')
    assert first == StepResult(
        TOOL_RESPONSE.format(output="7"), 0.0, False, {"tool": "calculator", "tool_status": "ok"}
    )
    final = env.step(" 7<|im_end|>")  # the verdict is the reward pool's (tests/envs/test_multiturn.py)
    assert (final.reward, final.done, final.grade) == (0.0, True, "7")


def test_math_env_wrong_answer_and_malformed_call():
    env = ToolMathEnv(prefill="call")
    env.reset(EXAMPLE)
    bad = env.step("3 + 4}</tool_call>")  # the model's JSON lacks a brace: "...": "3 + 4}
    assert bad.info["tool_status"] == "malformed" and not bad.done
    assert "malformed tool call: invalid JSON" in bad.observation
    retry = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>')
    assert "\n12\n" in retry.observation  # the model's own expression is what gets computed
    assert env.step(" 12<|im_end|>").grade == "12"  # handed over for grading: 12 is not 3 + 4


def test_math_env_rejects_bad_options_and_step_before_reset():
    with pytest.raises(ValueError, match="tool must be one of"):
        ToolMathEnv(tool="shell")
    with pytest.raises(ValueError, match="prefill"):
        ToolMathEnv(prefill="all")
    with pytest.raises(RuntimeError, match="before reset"):
        ToolMathEnv().step("x")


def test_answer_text_strips_chat_markers():
    assert answer_text(" 41363<|im_end|>") == "41363"


def test_registered_environments():
    assert ENVS.names() == ["calculator_math", "calculator_math_open", "python_math"]
    assert ENVS.get("python_math").make_env().tool == "python"
    with pytest.raises(KeyError, match="valid names: calculator_math"):
        ENVS.get("calculator")
