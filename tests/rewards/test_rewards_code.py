"""The `code` reward: fraction of tests passed by the completion's Python block, run in the sandbox."""

import pytest

from rljax.rewards import REWARDS
from rljax.rewards.code import extract_code

ASSERT_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


def code_score(completion, tests, **options):
    example = {"prompt": "write add", "answer": "", "tests": tests}
    return REWARDS.get("code")(prompt="", completion=completion, example=example, **options)


def test_extract_code_prefers_the_last_python_block():
    text = "```\nraw\n```\n```python\nfirst\n```\ntext\n```py\nsecond\n```"
    assert extract_code(text) == "second\n"
    assert extract_code("```\nonly\n```") == "only\n"
    assert extract_code("no block") is None and extract_code("x = 1", allow_raw=True) == "x = 1"


def test_assert_tests_score_the_fraction_passed():
    completion = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert code_score(completion, ASSERT_TESTS) == pytest.approx(2 / 3)
    assert code_score("no code at all", ASSERT_TESTS) == 0.0
    assert code_score("```python\ndef add(a, b):\n    return 0\n```", ASSERT_TESTS) == pytest.approx(1 / 3)


def test_stdin_stdout_cases():
    completion = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    cases = [
        {"input": "3 4\n", "output": "12"},
        {"input": "2 5", "output": "10\n"},
        {"input": "1 1", "output": "2"},
    ]
    assert code_score(completion, cases) == pytest.approx(2 / 3)


def test_exiting_early_or_hanging_passes_nothing():
    exits = "```python\nimport os\ndef add(a, b):\n    return a + b\nos._exit(0)\n```"
    assert code_score(exits, ASSERT_TESTS) == 0.0
    hangs = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert code_score(hangs, ASSERT_TESTS[:1], timeout_s=1.0) == 0.0


def test_forged_pass_markers_do_not_count():
    # Printing what a pass marker might look like is not a pass: pass/fail is decided outside the sandbox.
    forged = "```python\nfor i in range(3):\n    print(f'deadbeef:{i}')\ndef add(a, b):\n    return -99\n```"
    assert code_score(forged, ASSERT_TESTS) == 0.0


def test_bad_tests_raise():
    with pytest.raises(ValueError, match="empty"):
        code_score("```python\npass\n```", [])
    with pytest.raises(TypeError, match="str or a dict"):
        code_score("```python\npass\n```", [3])


def test_code_reward_through_the_pool():
    from rljax.rewards import RewardPool

    completion = "```python\ndef add(a, b):\n    return a + b\n```"
    batch = [{"prompt": "", "completion": completion, "example": {"answer": "", "tests": ASSERT_TESTS}}]
    with RewardPool([("code", 1.0, {"timeout_s": 2.0})], num_workers=1, timeout_s=10.0) as pool:
        assert pool.wait_ready()  # includes the sandbox probe (code_reward.warmup)
        rewards, _, metrics = pool.score(batch)
    assert rewards[0] == pytest.approx(2 / 3) and metrics["reward_fn/errors"] == 0


def test_check_forms_are_evaluated_outside_the_sandbox():
    code = "```python\nimport math\ndef area(r):\n    return math.pi * r * r\n"
    code += "def evens(n):\n    return [i for i in range(n) if i % 2 == 0]\n```"
    tests = [
        "assert math.isclose(area(1), 3.14159, rel_tol=1e-3)",
        "assert abs(area(2) - 12.566) < 1e-2",
        "assert 4 in evens(6) and 3 not in evens(6)",
        "assert len(evens(10)) == 5 and not evens(0)",
        "xs = evens(5)\nassert xs == [0, 2, 4]",
        "assert sorted(set(evens(7))) == [0, 2, 4, 6]",
        "assert evens(3) == [0, 2] == [0, 2.0]",
        "assert area(1) > 4",
    ]
    assert code_score(code, tests) == pytest.approx(7 / 8)


def test_checks_outside_top_level_asserts_are_rejected():
    with pytest.raises(ValueError, match="top-level assert"):
        code_score("```python\npass\n```", ["def check(f):\n    assert f(1) == 2\ncheck(g)"])
    with pytest.raises(ValueError, match="no top-level assert"):
        code_score("```python\npass\n```", ["x = 1"])
