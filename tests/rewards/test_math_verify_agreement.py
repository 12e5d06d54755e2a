"""The `math` reward agrees with Math-Verify's own labelled cases, and rejects what the old grader accepted.

tests/rewards/math_verify_cases.json: the labelled (gold, pred, expected) cases of math-verify 0.9.0's tests
(Apache-2.0) whose settings the reward's options express, written by benchmarks/bench_math_grading.py.
"""

import json
from pathlib import Path

import pytest

from rljax.rewards import REWARDS

_CASES = json.loads((Path(__file__).parent / "math_verify_cases.json").read_text())["cases"]


def grade(pred, gold, **options):
    return REWARDS.get("math")(prompt="q", completion=pred, example={"answer": gold}, **options)


def test_vendored_cases_hold_both_labels():
    labels = [case["expected"] for case in _CASES]
    assert len(_CASES) >= 100 and 0 < labels.count(False) < labels.count(True)


@pytest.mark.parametrize("case", _CASES, ids=[f"{c['file']}:{c['test']}:{i}" for i, c in enumerate(_CASES)])
def test_reward_agrees_with_math_verify_label(case):
    options = {"float_rounding": case["float_rounding"], "strict": case["strict"]}
    assert grade(case["pred"], case["gold"], **options) == float(case["expected"])


# Wrong answers the hand-written grader (the `math` reward up to d4b06cb) accepted, each labelled wrong by
# Math-Verify's tests (file:test named); measured by benchmarks/bench_math_grading.py.
@pytest.mark.parametrize(
    "gold, pred, why",
    [
        ("$a +3z = 0$", "$0$", "the reference equation's right-hand side (test_all:test_relations_math)"),
        ("$2x + z = 1$", "$1$", "the reference equation's right-hand side (test_all:test_relations_math)"),
        ("$a^2 + b = 0$", "$0$", "the reference equation's right-hand side (test_all:test_relations_math)"),
        ("$1$", "$-[0,1)$", "the last number of an interval (test_all:test_sets_handling)"),
        ("$2$", r"$\frac{1+\sqrt{5}}{2}$", "a fraction's last number (test_complex_math_expressions)"),
        (r"So the answer is: \[ \boxed{32349} \]", r"is $\boxed{32, 349}$", "a pair read as one number"),
    ],
)
def test_old_graders_false_accepts_are_rejected(gold, pred, why):
    assert grade(pred, gold) == 0.0, why
