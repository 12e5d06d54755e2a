"""Code-execution reward: run the completion's Python block against the example's tests in the sandbox.

`example["tests"]` is a list whose items are either assert-style test code (str; all run in one sandbox
after the solution, sharing the solution's globals) or stdin/stdout cases ({"input": str, "output": str};
one sandbox run each, compared line by line with trailing whitespace stripped). A single str is one
assert-style test.

Integrity (docs/security.md): pass/fail is never decided inside the sandbox. An assert test is split by
`code_checks.plan_tests` into probes (the solution-dependent sub-expressions, e.g. `f(3)`), which the
sandbox evaluates and returns as plain JSON values, and a check (e.g. `== 9`), evaluated here with a
type-exact equality; the expected values never enter the solution's sandbox (one beyond the constant
grammar is computed by a sandbox run without the solution, once per test set). Each probe counts once
(a probe reported twice counts nothing), so forged output, early exits, crashes and floods score at most
the real results.
Only top-level `assert` statements are checks; a test with an assert or raise elsewhere is rejected.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from typing import Any

from rljax.rewards.base import REWARDS, declare_range
from rljax.rewards.code_checks import passes, plan_tests, with_expected
from rljax.rewards.code_records import read_probes
from rljax.rewards.sandbox import run_python, sandbox_info

_BLOCK_RE = re.compile(r"```[ \t]*(python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str, *, allow_raw: bool = False) -> str | None:
    """The last ```python (or, failing that, the last unlabeled ```) block; the raw text if allow_raw."""
    blocks = _BLOCK_RE.findall(completion)
    labelled = [body for lang, body in blocks if lang]
    if labelled:
        return labelled[-1]
    if blocks:
        return blocks[-1][1]
    return completion if allow_raw else None


_HARNESS = pathlib.Path(__file__).with_name("_code_harness.py")


def _harness_run(solution: str, tests: list[list[list[Any]]], sandbox: dict[str, Any]) -> str:
    payload = {"solution": solution, "tests": tests}
    program = f"import json\nPAYLOAD = json.loads({json.dumps(payload)!r})\n"
    return run_python(program + _HARNESS.read_text(), **sandbox).stdout


@functools.lru_cache(maxsize=4096)
def _expected_values(tests_json: str, sandbox_json: str) -> tuple[dict[int, Any], ...]:
    """Each test's expected values, computed once per test set by a sandbox run with no solution in it."""
    tests, sandbox = json.loads(tests_json), json.loads(sandbox_json)
    out, offset = [], 0
    renumbered = []
    for steps in tests:  # one id space for the run: offset each test's expected probe ids
        renumbered.append([s if s[0] == "setup" else ["probe", s[1] + offset, s[2]] for s in steps])
        offset += sum(s[0] == "probe" for s in steps)
    values = read_probes(_harness_run("", renumbered, sandbox), offset)
    offset = 0
    for steps in tests:
        n = sum(s[0] == "probe" for s in steps)
        out.append({i: values[i + offset] for i in range(n) if i + offset in values})
        offset += n
    return tuple(out)


def _count_assert_passes(solution: str, tests: list[str], sandbox: dict[str, Any]) -> int:
    """Probes run in the solution's sandbox; expected values beyond constants in one without it (cached
    per test set); the checks are evaluated here."""
    if not tests:
        return 0
    plans = plan_tests(tests)
    if any(plan.expected_steps for plan in plans):
        expected = [[list(step) for step in plan.expected_steps] for plan in plans]
        values = _expected_values(json.dumps(expected), json.dumps(sandbox, sort_keys=True))
        plans = [with_expected(plan, v, i) for i, (plan, v) in enumerate(zip(plans, values, strict=True))]
    stdout = _harness_run(solution, [[list(step) for step in plan.steps] for plan in plans], sandbox)
    num_probes = sum(step[0] == "probe" for plan in plans for step in plan.steps)
    values = read_probes(stdout, num_probes)
    return sum(passes(plan, values) for plan in plans)


def _normalize_output(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _count_io_passes(solution: str, cases: list[dict[str, str]], sandbox: dict[str, Any]) -> int:
    passed = 0
    for case in cases:
        result = run_python(solution, stdin=str(case.get("input", "")), **sandbox)
        ok = result.returncode == 0 and not result.timed_out
        passed += ok and _normalize_output(result.stdout) == _normalize_output(str(case["output"]))
    return passed


@REWARDS.register("code")
@declare_range((0.0, 1.0))
def code_reward(
    *,
    prompt: str,
    completion: str,
    example: dict[str, Any],
    tests_key: str = "tests",
    timeout_s: float = 3.0,
    memory_mb: int = 512,
    max_file_mb: int = 16,
    max_procs: int = 32,
    allow_raw: bool = False,
) -> float:
    """Fraction of example[tests_key] that the completion's code passes (0.0 without a code block).

    Keep `timeout_s` (per sandbox run) below the reward pool's per-call timeout.
    References: execution-based rewards as in CodeRL (Le et al. 2022, arXiv:2207.01780) and the
    HumanEval/MBPP assert-test convention (Chen et al. 2021, arXiv:2107.03374).
    """
    tests = example[tests_key]
    tests = [tests] if isinstance(tests, str) else list(tests)
    if not tests:
        raise ValueError(f"example[{tests_key!r}] is empty: nothing to score")
    solution = extract_code(completion, allow_raw=allow_raw)
    if solution is None:
        return 0.0
    sandbox = dict(timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=max_file_mb, max_procs=max_procs)
    asserts = [t for t in tests if isinstance(t, str)]
    cases = [t for t in tests if isinstance(t, dict)]
    if len(asserts) + len(cases) != len(tests):
        raise TypeError(f"each test must be a str or a dict(input, output), got {tests!r}")
    passed = _count_assert_passes(solution, asserts, sandbox) + _count_io_passes(solution, cases, sandbox)
    return passed / len(tests)


code_reward.warmup = sandbox_info  # RewardPool workers probe the sandbox once, before taking calls
