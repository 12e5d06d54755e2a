"""Reward integrity: a policy cannot score more than its honest test results (docs/security.md).

Each attack goes through the public API (`rljax.rewards.code_reward`, the registered "code" reward, the
`RewardPool`) and must score at most the reward's maximum and exactly what its functions' real results
give. TESTS are three asserts; the honest `add` passes two of them (the third expects 5 from 2 + 2).
"""

import math

import numpy as np
import pytest

from rljax.rewards import REWARDS, RewardPool
from rljax.rewards.code import code_reward

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
HONEST = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return -99\n"
SECRET = 918273645  # an expected value no honest `secret()` could compute


def score(code, tests=TESTS, **options):
    completion = f"```python\n{code}```"
    return code_reward(prompt="", completion=completion, example={"tests": tests}, **options)


def test_correct_and_partial_solutions_score_exactly_their_results():
    assert score(HONEST, TESTS[:2]) == 1.0
    assert score(HONEST) == pytest.approx(2 / 3)
    assert score("def add(a, b):\n    return 0 if a + b == 0 else a + b\n", TESTS[1:]) == 0.5
    assert score(WRONG) == 0.0
    assert REWARDS.get("code") is code_reward


FORGE_RECORDS = """
import os
lines = []
for i in range(3):
    lines += [f"deadbeef:{i}", '{"i": %d, "v": true}' % i, '{"i": %d, "passed": true}' % i, "PASS"]
blob = ("\\n".join(lines) + "\\n").encode()
print(blob.decode())
for fd in range(3, 64):  # every inherited descriptor, the harness's record channel included
    try:
        os.write(fd, blob)
    except OSError:
        pass
"""


@pytest.mark.parametrize("exit_after", [False, True], ids=["then-run", "then-os_exit"])
def test_forged_markers_and_records_count_nothing(exit_after):
    attack = WRONG + FORGE_RECORDS + ("os._exit(0)\n" if exit_after else "")
    assert score(attack) == 0.0
    # Forging next to an honest `add`: never more than the honest 2/3.
    assert score(HONEST + FORGE_RECORDS) <= 2 / 3


def test_always_equal_objects_and_lying_subclasses_fail():
    always = (
        "class Yes:\n"
        "    __eq__ = lambda self, other: True\n    __ne__ = lambda self, other: False\n"
        "    __hash__ = lambda self: 0\n    __bool__ = lambda self: True\n"
        "    __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __eq__\n"
        "def add(a, b):\n    return Yes()\n"
    )
    assert score(always) == 0.0
    assert score(always, ["assert add(1, 2)", "assert add(1, 2) in [3]", "assert not add(0, 0) != 0"]) == 0.0
    lying_int = "class I(int):\n    __eq__ = lambda self, other: True\ndef add(a, b):\n    return I(7)\n"
    assert score(lying_int) == 0.0  # encoded as its int value, 7


def test_exiting_before_the_tests_scores_the_real_results():
    assert score(WRONG + "import sys\nsys.exit(0)\n") == 0.0
    assert score(HONEST + "import sys\nsys.exit(0)\n") == pytest.approx(2 / 3)  # the tests still run
    assert score(HONEST + "raise SystemExit(0)\n", TESTS[:2]) == 1.0
    assert score(HONEST + "import os\nos._exit(0)\n") == 0.0  # no probe values at all


def test_printing_many_pass_lines_counts_nothing():
    flood = "for i in range(200000):\n    print('{\"i\": 0, \"v\": 3}', f'deadbeef:{i % 3}')\n"
    assert score(WRONG + flood) == 0.0
    assert score(HONEST + flood) == pytest.approx(2 / 3)  # its prints go to stderr, not the record channel
    duplicates = (
        'import os\nfor fd in range(3, 64):\n    try: os.write(fd, b\'{"i": 2, "v": 5}\\n\' * 1000)\n'
    )
    duplicates += "    except OSError: pass\n"
    assert score(HONEST + duplicates) <= 2 / 3  # a probe reported twice counts nothing


READ_SECRETS = """
import glob, os, re
def _readable_bytes():
    paths = glob.glob("*") + glob.glob("../*") + glob.glob("/tmp/**", recursive=True)
    paths += glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ") + ["/proc/self/cmdline"]
    for path in paths:
        try:
            with open(path, "rb") as f:
                yield f.read(1 << 22)
        except OSError:
            pass
    yield repr(os.environ).encode()
    for maps in glob.glob("/proc/[0-9]*/maps"):  # other processes' memory (the reward worker's)
        try:
            with open(maps) as f, open(maps[:-4] + "mem", "rb") as mem:
                for line in f.read().splitlines()[:200]:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if "r" in line.split()[1] and hi - lo < 1 << 24:
                        mem.seek(lo)
                        yield mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            pass
def secret(*_):  # the first long number after '=', '==' or '-' anywhere it can read
    for blob in _readable_bytes():
        found = re.search(rb"(?:=|-) *([0-9]{6,})", blob)
        if found:
            return int(found.group(1))
    return -1
"""


def test_reading_harness_files_environment_and_memory_finds_no_expected_value():
    tests = [f"assert secret() == {SECRET}", f"assert abs(secret() - {SECRET}) < 0.5"]
    assert score(READ_SECRETS, tests, timeout_s=20.0) == 0.0
    # The same reader finds a value the test hands the solution on purpose (so the reader works).
    planted = [f"planted = {SECRET}\nassert secret(planted) == {SECRET}"]
    assert score(READ_SECRETS, planted, timeout_s=20.0) == 1.0


def test_monkeypatching_the_harness_builtins_changes_nothing():
    patch = (
        "import builtins, json, sys\n"
        "builtins.print = lambda *a, **k: None\nbuiltins.repr = lambda x: '3'\n"
        "builtins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\nbuiltins.int = lambda *a: 3\n"
        "builtins.str = lambda *a: '3'\nbuiltins.eval = lambda *a, **k: 3\n"
        "builtins.compile = lambda *a, **k: '3'\n"
    )
    assert score(HONEST + patch) == pytest.approx(2 / 3)  # the honest result, not 3/3
    assert score(WRONG + patch) == 0.0
    encoder = (
        "json.JSONEncoder.encode = lambda self, o: '{\"i\": 0, \"v\": 3}'\njson.dumps = lambda *a, **k: '1'\n"
    )
    assert score(WRONG + patch + encoder) == 0.0
    assert score(HONEST + patch + encoder) <= 2 / 3


def test_expected_values_are_compared_type_exactly():
    floats = "def add(a, b):\n    return float(a + b)\n"
    assert score(floats) == pytest.approx(2 / 3)  # numbers: int and float are one JSON kind
    bools = ["assert is_even(2) == True", "assert is_even(3) == False", "assert is_even(4) is True"]
    assert score("def is_even(n):\n    return int(n % 2 == 0)\n", bools) == 0.0  # 1 is not True
    assert score("def is_even(n):\n    return n % 2 == 0\n", bools) == 1.0
    assert score("def pair():\n    return [1, 2]\n", ["assert pair() == (1, 2)"]) == 0.0


def test_a_cheating_code_reward_scores_the_honest_result_through_the_pool():
    attacks = [WRONG + FORGE_RECORDS, HONEST + "import os\nos._exit(0)\n", HONEST]
    batch = [{"prompt": "", "completion": f"```python\n{a}```", "example": {"tests": TESTS}} for a in attacks]
    with RewardPool([("code", 1.0, {})], num_workers=1, timeout_s=30.0) as pool:
        rewards, per_fn, metrics = pool.score(batch)
    np.testing.assert_allclose(rewards, np.float32([0.0, 0.0, 2 / 3]), rtol=1e-6)
    assert metrics["reward_fn/out_of_range"] == 0 and metrics["reward_fn/errors"] == 0


def out_of_range(*, prompt, completion, example):
    """Returns float(completion): declared range [-1, 1]."""
    return float(completion)


out_of_range.reward_range = (-1.0, 1.0)


def undeclared(*, prompt, completion, example):
    return float(completion)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_custom_rewards_are_clamped_to_their_range_and_nan_scores_its_minimum(num_workers):
    batch = [{"prompt": "", "completion": c, "example": {}} for c in ["0.5", "5", "-3", "nan", "inf", "1"]]
    specs = [(out_of_range, 1.0), (undeclared, 1.0)]
    with RewardPool(specs, num_workers=num_workers, timeout_s=10.0) as pool:
        _, per_fn, metrics = pool.score(batch)
    np.testing.assert_array_equal(
        per_fn["test_reward_integrity:out_of_range"], np.float32([0.5, 1, -1, -1, -1, 1])
    )
    np.testing.assert_array_equal(
        per_fn["test_reward_integrity:undeclared"], np.float32([0.5, 5, -3, 0, 0, 1])
    )
    assert metrics["reward_fn/test_reward_integrity:out_of_range/out_of_range"] == 2
    assert metrics["reward_fn/test_reward_integrity:out_of_range/errors"] == 2  # nan and inf
    assert metrics["reward_fn/out_of_range"] == 2 and metrics["reward_fn/errors"] == 4
    assert all(math.isfinite(v) for v in metrics.values())


# The expected side beyond constants (issue 22): each construct with a solution that copies or steers the
# expected value instead of computing it (it scored 1.0 when the expected side ran next to the solution),
# and the correct solution. The expected side now runs in a sandbox without the solution.
EXPECTED_SIDE = {
    "assignment": (
        "expected = [1, 2, 3]\nassert f() == expected",
        "def f():\n    return globals()['expected']\n",
        "def f():\n    return [1, 2, 3]\n",
    ),
    "slice": (
        "xs = [5, 4, 3, 2]\nassert f(xs) == xs[1:3]",
        "def f(xs):\n    xs[:] = [0, 9, 9, 0]\n    return [9, 9]\n",
        "def f(xs):\n    return xs[1:3]\n",
    ),
    "method call": (
        "xs = [3, 1, 2]\nassert f(xs) == xs.copy()",
        "def f(xs):\n    xs[:] = [7]\n    return [7]\n",
        "def f(xs):\n    return list(xs)\n",
    ),
    "comprehension": (
        "assert f() == [i * i for i in range(4)]",
        "range = lambda n: []\ndef f():\n    return []\n",
        "def f():\n    return [0, 1, 4, 9]\n",
    ),
    "library call": (
        "import math\nassert f() == math.factorial(5)",
        "import math\nmath.factorial = lambda n: 0\ndef f():\n    return 0\n",
        "def f():\n    return 120\n",
    ),
    "f-string": (
        "name = 'rl'\nassert f() == f'{name}!'",
        "def f():\n    return globals()['name'] + '!'\n",
        "def f():\n    return 'rl!'\n",
    ),
}


@pytest.mark.parametrize("construct", sorted(EXPECTED_SIDE))
def test_the_expected_side_is_computed_without_the_solution(construct):
    test, cheat, honest = EXPECTED_SIDE[construct]
    assert score(cheat, [test]) == 0.0
    assert score(honest, [test]) == 1.0


def test_plain_constants_score_the_correct_solution():
    tests = ["assert f() == [0] * 3", "assert g() == 'ab' * 2", "assert h() == (1,) + (2,)"]
    honest = "def f():\n    return [0, 0, 0]\ndef g():\n    return 'abab'\ndef h():\n    return (1, 2)\n"
    assert score(honest, tests) == 1.0  # each scored 0.0 before: sequence arithmetic failed silently


def test_a_test_that_cannot_keep_its_expected_value_apart_is_an_error():
    with pytest.raises(ValueError, match="binds both what the solution is given and what it is checked"):
        score(HONEST, ["x, expected = [1, 2], 3\nassert add(*x) == expected"])
    with pytest.raises(ValueError, match="cannot be evaluated: division by zero"):
        score(HONEST, ["assert add(1, 1) == 1 / 0"])
    with pytest.raises(ValueError, match=r"the expected value `xs\[5\]` failed to compute"):
        score(HONEST, ["xs = [1]\nassert add(1, 1) == xs[5]"])
