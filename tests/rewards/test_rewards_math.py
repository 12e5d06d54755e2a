"""Verifiers without processes: math (Math-Verify), format, length penalties, countdown, resolve."""

import concurrent.futures
import pathlib
import subprocess
import sys
import time

import pytest

from rljax.rewards import REWARDS, resolve
from rljax.rewards.base import reward_range
from rljax.rewards.countdown import check_countdown, extract_expression
from rljax.rewards.math_verify import ANSWER_EXTRACTORS, find_boxed, reference_answer


def score(name, completion, answer="", **options):
    example = {"prompt": "q", "answer": answer}
    return REWARDS.get(name)(prompt="q", completion=completion, example=example, **options)


def test_registry_has_the_builtins_and_rejects_duplicates():
    assert {"math", "format", "length_penalty", "overlong", "code", "countdown"} <= set(REWARDS.names())
    with pytest.raises(ValueError, match="duplicate"):
        REWARDS.add("math", lambda **kw: 0.0)


@pytest.mark.parametrize(
    "extract, text, expected",
    [
        ("auto", "anything", "anything"),  # Math-Verify finds the answer itself
        ("boxed", r"so \boxed{\frac{3}{4}} done", r"\boxed{\frac{3}{4}}"),
        ("boxed", r"\boxed{1} then \boxed{ {2} + \{x\} }", r"\boxed{ {2} + \{x\} }"),  # last box, braces kept
        ("boxed", "no box", None),
        ("hash", "work\n#### 1,234\n", "1,234"),
        ("hash", "#### 1\n#### \n", "1"),  # the last non-empty one
        ("hash", "no hash", None),
        ("last_line", "work\nx = 5\n\n", "x = 5"),
        ("last_line", " \n", None),
    ],
)
def test_answer_extractors(extract, text, expected):
    assert ANSWER_EXTRACTORS.get(extract)(text) == expected


def test_find_boxed_nested_unbalanced_fbox_and_linear():
    assert find_boxed(r"\fbox{a{b}c} \boxed{open") == ["a{b}c"]
    assert find_boxed(r"\boxed{a \boxed{b}} \boxed{}") == [r"a \boxed{b}", "b", ""]
    start = time.monotonic()
    assert find_boxed("\\boxed{" * 100_000) == []  # one pass: 100k unclosed boxes in well under a second
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize(
    "answer, reference",
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),  # GSM8K
        ("#### 1,234", "1,234"),
        (17, "17"),
        ("1,5", "1,5"),  # plain numbers stay as they are
        ("-0.5%", "-0.5%"),
        (r"\frac{3}{4}", r"$\frac{3}{4}$"),  # bare LaTeX is delimited
        ("(1, 2)", "$(1, 2)$"),
        ("y = 2x + 3", "$y = 2x + 3$"),
        (r"so $x$ is \boxed{3}", r"so $x$ is \boxed{3}"),
    ],
)
def test_reference_answer(answer, reference):
    assert reference_answer({"answer": answer}) == reference


@pytest.mark.parametrize(
    "completion, answer, options, expected",
    [
        # The default job's outputs: a bare number after "a + b ="; with junk after it, the last number
        # that stands alone (Math-Verify's plain-number reading, as today's last-number fallback).
        (" 12", "12", {}, 1.0),
        (" 13", "12", {}, 0.0),
        ("12 3", "3", {}, 1.0),
        ("12 3", "12", {}, 0.0),
        (r"... \boxed{72}", "72", {}, 1.0),
        ("... #### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", {}, 1.0),
        ("so 3/4 of it", r"\frac{3}{4}", {}, 1.0),
        ("The answer is 0.5", r"\frac{1}{2}", {}, 1.0),
        ("It costs $1,000.", "1000", {}, 1.0),
        ("50%", "0.5", {}, 1.0),
        (r"$x = 5$", "5", {}, 1.0),  # an assignment's value
        (r"\boxed{\{1, 2\}}", r"\{2, 1\}", {}, 1.0),  # sets, unordered
        (r"\boxed{(1, 2]}", "(1, 2)", {}, 0.0),  # intervals: ends matter
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", {}, 1.0),  # symbolic equality
        ("3", r"3\sqrt{2}", {}, 0.0),  # a bare LaTeX reference is read whole, not as its first number
        ("2", "(1, 2)", {}, 0.0),
        (r"\boxed{71}", "72", {}, 0.0),
        (r"\boxed{7}. Check: 7 + 5 = 12", "12", {}, 0.0),  # the boxed answer counts, not the last number
        ("nothing", "72", {}, 0.0),
        # Explicit extraction: only that part is graded.
        ("it is 72", "72", {"extract": "boxed"}, 0.0),
        (r"\boxed{71} ... \boxed{72}", "72", {"extract": "boxed"}, 1.0),
        ("72 then\n#### 71", "72", {"extract": "hash"}, 0.0),
        ("so\n#### 72", "72", {"extract": "hash"}, 1.0),
        ("72\nwhatever", "72", {"extract": "last_line"}, 0.0),
        # Options: the reward's values, verify's rounding, and only the tail is read.
        (r"\boxed{2}", "2", {"correct": 2.5}, 2.5),
        (r"\boxed{3}", "2", {"incorrect": -1.0}, -1.0),
        ("0.3333", r"\frac{1}{3}", {"float_rounding": 4}, 1.0),
        ("0.3333", r"\frac{1}{3}", {}, 0.0),
        (r"\boxed{72}" + " filler" * 1000, "72", {"max_chars": 1000}, 0.0),
    ],
)
def test_math_reward_golden(completion, answer, options, expected):
    assert score("math", completion, answer, **options) == expected


def test_math_reward_unknown_extract_fails_when_the_range_is_read():
    with pytest.raises(KeyError, match="valid names: auto, boxed, hash, last_line"):
        reward_range(REWARDS.get("math"), {"extract": "last_number"})


def test_math_reward_off_the_main_thread_does_not_crash():
    # SIGALRM (math-verify's timeouts) works only in a main thread; an env step runs in its own thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(score, "math", r"\boxed{\frac{1}{2}}", "0.5").result(timeout=60) == 1.0
        assert pool.submit(score, "math", r"\boxed{3}", "0.5").result(timeout=60) == 0.0


_DET_12 = "\\\\".join("&".join(f"x_{{{i}{j}}}" for j in range(12)) for i in range(12))
_ADVERSARIAL = {
    "power tower": "9^9^9^9",
    "python power tower": "10**10**10",
    "latex power tower": r"so \boxed{10^{10^{10}}}",
    "huge factorial": r"$(10^{10})!$",
    "huge sum": r"\boxed{\sum_{k=1}^{10^{9}} k^k}",
    "huge product": r"\boxed{\prod_{k=1}^{10^{9}} k}",
    "huge binomial": r"\boxed{\binom{10^{10}}{10^{5}}}",
    "symbolic power": r"\boxed{(x+1)^{100000}}",
    "power chain": "$" + "x^" * 500 + "2$",
    "nested parentheses": "$" + "(" * 3000 + "1" + ")" * 3000 + "$",
    "12x12 symbolic determinant": r"$\det\begin{pmatrix}" + _DET_12 + r"\end{pmatrix}$",
    "long digit string": "1" * 100_000,
    "a megabyte of unclosed boxes": "\\boxed{" * 150_000,
    "a megabyte of dollars": "$" * 1_000_000,
}


def _idle_then_score():
    for _ in range(30):  # Python bytecode for 0.3 s: a deadline left armed would raise in here
        time.sleep(0.01)
    return score("math", " 12", "12")


@pytest.mark.parametrize("name", list(_ADVERSARIAL))
def test_math_reward_bounded_on_adversarial_completions(name):
    # Generous bounds for a loaded 2-core machine: with timeout_s=1, a main-thread call makes at most a
    # few 1 s math-verify attempts and a thread's deadline is 3 s; unbounded, several of these run for
    # minutes or exhaust memory.
    completion = _ADVERSARIAL[name]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # off the main thread first (no caches warm)
        start = time.monotonic()
        assert pool.submit(score, "math", completion, "12", timeout_s=1).result(timeout=60) == 0.0
        assert time.monotonic() - start < 10.0
        assert pool.submit(_idle_then_score).result(timeout=60) == 1.0  # the same thread: no stray deadline
    start = time.monotonic()
    assert score("math", completion, "12", timeout_s=1) == 0.0
    assert time.monotonic() - start < 10.0


def test_format_reward():
    assert score("format", r"x \boxed{3}") == 1.0
    assert score("format", r"x \boxed{ }") == 0.0
    assert score("format", "x\n#### 3", kind="hash") == 1.0
    assert score("format", "#### ", kind="hash", penalty=-1.0) == -1.0
    assert score("format", "<think>hm</think> 3", kind="think") == 1.0
    assert score("format", "ANSWER=3", regex=r"ANSWER=\d") == 1.0
    with pytest.raises(ValueError, match="valid: boxed"):
        score("format", "x", kind="nope")


def test_length_penalty_golden():
    assert score("length_penalty", "x" * 150, coef=0.01, target=100) == pytest.approx(-0.5)
    assert score("length_penalty", "x" * 50, coef=0.01, target=100) == 0.0
    assert score("length_penalty", "x" * 1000, coef=0.01, max_penalty=2.0) == -2.0
    assert score("length_penalty", "a b c d", coef=1.0, unit="words") == -4.0


@pytest.mark.parametrize("length, expected", [(0, 0.0), (80, 0.0), (90, -0.5), (100, -1.0), (101, -1.0)])
def test_overlong_golden(length, expected):
    # max_length 100, buffer 20: zero up to 80, linear to -1 at 100 (DAPO Eq. 13).
    example = {"prompt": "q", "answer": "", "num_completion_tokens": length}
    value = REWARDS.get("overlong")(prompt="q", completion="", example=example, max_length=100, buffer=20)
    assert value == pytest.approx(expected)


def test_overlong_needs_token_count():
    with pytest.raises(KeyError, match="num_completion_tokens"):
        score("overlong", "abc", max_length=10, buffer=2)
    assert score("overlong", "x" * 9, max_length=10, buffer=2, unit="chars") == pytest.approx(-0.5)


@pytest.mark.parametrize(
    "expression, ok",
    [
        ("(16 / 4) * 7", True),
        ("7 * 16 / 4", True),
        ("16 * 7 / 4", True),
        ("7 * 4", False),  # does not use 16
        ("16 + 16 - 4", False),  # 16 twice
        ("(16 - 4) * 7 - 56", False),  # 56 not given
        ("28", False),
        ("__import__('os')", False),
        ("-4 + 16 + 16", False),
        ("16 / 0 + 7 + 4", False),
    ],
)
def test_countdown_checker(expression, ok):
    assert check_countdown(expression, [7, 4, 16], 28) is ok


def test_countdown_reward_extraction():
    example = {"prompt": "q", "answer": "28", "numbers": [7, 4, 16], "target": 28}
    fn = REWARDS.get("countdown")
    assert fn(prompt="", completion="think... <answer>16/4*7</answer>", example=example) == 1.0
    assert fn(prompt="", completion="so\n(16 / 4) \u00d7 7 = 28", example=example) == 1.0
    assert fn(prompt="", completion="<answer>7+4+16</answer>", example=example, format_score=0.1) == 0.1
    assert fn(prompt="", completion="<answer>seven</answer>", example=example, format_score=0.1) == 0.0
    assert extract_expression(r"\boxed{7 + 4} = 11") == "7 + 4"


def test_resolve_builtin_and_custom():
    assert resolve("math") is REWARDS.get("math")
    import os.path

    assert resolve("os.path:join") is os.path.join
    with pytest.raises(ValueError, match="no_such_module_xyz:f"):
        resolve("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="'os.path:nope'.*no attribute"):
        resolve("os.path:nope")
    with pytest.raises(ValueError, match="not callable"):
        resolve("os.path:sep")
    with pytest.raises(KeyError, match="valid names"):
        resolve("maht")


_LOST_ALARM = """
import signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
import test_rewards_math as T

def cancel_alarms():  # other code in the process re-arms the one process timer: math-verify's alarms are lost
    while True:
        signal.alarm(0)
        time.sleep(0.02)

threading.Thread(target=cancel_alarms, daemon=True).start()
start = time.monotonic()
value = T.score("math", T._ADVERSARIAL["12x12 symbolic determinant"], "12", timeout_s=1)
print(value, time.monotonic() - start)
"""


def test_a_lost_alarm_in_the_main_thread_is_still_bounded():
    """Math-Verify bounds a main-thread parse with SIGALRM; with its alarm lost (cancelled here by other
    code; seen once in a long-lived test worker) the determinant runs for minutes unless the backstop
    deadline ends it."""
    here = str(pathlib.Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", _LOST_ALARM, here], capture_output=True, text=True, timeout=120, check=True
    )
    value, seconds = out.stdout.split()
    assert float(value) == 0.0 and float(seconds) < 20.0, out.stdout
