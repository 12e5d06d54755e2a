"""Verifiers without processes: math extraction/equivalence, format, length penalties, countdown, resolve."""

from fractions import Fraction

import pytest

from rljax.rewards import REWARDS, resolve
from rljax.rewards.countdown import check_countdown, extract_expression
from rljax.rewards.math_verify import answers_match, extract_answer, find_boxed, parse_number


def score(name, completion, answer="", **options):
    example = {"prompt": "q", "answer": answer}
    return REWARDS.get(name)(prompt="q", completion=completion, example=example, **options)


def test_registry_has_the_builtins_and_rejects_duplicates():
    assert {"math", "format", "length_penalty", "overlong", "code", "countdown"} <= set(REWARDS.names())
    with pytest.raises(ValueError, match="duplicate"):
        REWARDS.add("math", lambda **kw: 0.0)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{3}{4}} done", r"\frac{3}{4}"),
        (r"\boxed{1} then \boxed{ {2} + \{x\} }", r"{2} + \{x\}"),  # last box, nested braces kept
        ("work\n#### 1,234\n", "1,234"),
        ("The answer is 17.", "17"),
        ("Answer: -5", "-5"),
        ("I get 3 then 4 and finally 12 apples", "12"),
        ("no numbers here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_find_boxed_handles_unbalanced_and_fbox():
    assert find_boxed(r"\fbox{a{b}c} \boxed{open") == ["a{b}c"]


@pytest.mark.parametrize(
    "text, values",
    [
        ("42", [Fraction(42)]),
        ("-3", [Fraction(-3)]),
        ("+3", [Fraction(3)]),
        ("1,234,567", [Fraction(1234567)]),
        ("0.75", [Fraction(3, 4)]),
        (".5", [Fraction(1, 2)]),
        ("3/4", [Fraction(3, 4)]),
        (r"\frac{3}{4}", [Fraction(3, 4)]),
        (r"-\dfrac{6}{8}", [Fraction(-3, 4)]),
        (r"\frac12", [Fraction(1, 2)]),
        ("\u22127", [Fraction(-7)]),  # unicode minus
        (r"$18.00$", [Fraction(18)]),
        ("x = 5", [Fraction(5)]),
        (r"50\%", [Fraction(50), Fraction(1, 2)]),
        ("25%", [Fraction(25), Fraction(1, 4)]),
        (r"7 \text{ apples}", [Fraction(7)]),
        ("1e3", [Fraction(1000)]),
        ("abc", []),
        ("1/0", []),
        ("2 or 3", []),
        ("x+1", []),
        ("about 7 dollars", [Fraction(7)]),
    ],
)
def test_parse_number(text, values):
    assert parse_number(text) == values


@pytest.mark.parametrize(
    "pred, ref, same",
    [
        ("0.5", "1/2", True),
        (r"\frac{1}{2}", "0.50", True),
        ("1,000", "1000", True),
        ("50%", "0.5", True),
        ("50%", "50", True),
        ("-2", "2", False),
        ("0.333", "1/3", False),  # exact comparison: a rounded decimal is not a third
        ("x+1", "x + 1", True),  # non-numeric answers compare as normalised text
        ("x+1", "x+2", False),
        ("", "", False),
    ],
)
def test_answers_match(pred, ref, same):
    assert answers_match(pred, ref) is same


def test_math_reward_forms_and_gsm8k_reference():
    assert score("math", r"... \boxed{72}", "72") == 1.0
    assert score("math", "... #### 72", "Natalia sold 48/2 = 24 clips.\n#### 72") == 1.0
    assert score("math", "so 3/4 of it", r"\frac{3}{4}") == 1.0
    assert score("math", r"\boxed{71}", "72") == 0.0
    assert score("math", "nothing", "72") == 0.0
    assert score("math", "it is 72", "72", fallback_last_number=False) == 0.0
    assert score("math", r"\boxed{2}", "2", correct=2.5) == 2.5


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
