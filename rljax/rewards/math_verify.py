"""The `math` reward: a completion's final answer graded against the reference by Hugging Face's Math-Verify.

`math_verify.parse` extracts and parses the answer (LaTeX: `\\boxed{}` first, then `$...$`, `\\[...\\]`,
"final answer is ..."; then plain expressions and numbers: "answer: 7", else the last one in the text)
into sympy, and `math_verify.verify` compares it with the parsed reference: numbers within
`float_rounding` decimals, fractions, percentages, symbolic equality, sets, intervals, matrices and
equations. The `extract` option picks the text handed to it: "auto" (the whole completion's tail), or
"boxed", "hash" (`#### x`) or "last_line" (ANSWER_EXTRACTORS; no such part scores `incorrect`).

Untrusted text is bounded before and after parsing: only the last `max_chars` characters are read; a
text nesting brackets deeper than `_MAX_NESTING` or chaining powers (x^x^x^...) is rejected unparsed
(`_too_nested`); a parsed answer whose value could not be computed quickly (9^9^9^9, (10^10)!,
\\sum_{k=1}^{10^9} k^k, (x+1)^100000: `_bits`) is rejected before comparison; and math-verify's own
timeouts (SIGALRM, `timeout_s` per parse or comparison) are on in a main thread (the reward pool's
workers call rewards there). Off the main thread (an environment's step thread) SIGALRM cannot be used:
math-verify's timeouts are off there and `_ThreadDeadline` raises the same exception in the grading
thread after 3 * timeout_s. The reward pool's per-call kill is the outer bound.
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException
from sympy import Basic, Float, Integer, Product, Rational, Sum
from sympy.core.add import Add
from sympy.core.mul import Mul
from sympy.core.power import Pow

from rljax.registry import Registry
from rljax.rewards.base import REWARDS, declare_range

# Boxed answers before "final answer is" (priority 0): what Math-Verify's own tests use for free-form
# answers, and what a model trained on the `\boxed{}` convention (MATH, arXiv:2103.03874) writes last.
_TARGETS = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
# Exact integers up to ~40k digits compare in milliseconds; 9^9^9^9, (10^10)! or \prod_{k=1}^{10^9} k take
# minutes and gigabytes, partly in big-integer C code that neither SIGALRM nor _ThreadDeadline interrupts
# (measured: the product held the GIL for minutes in a thread).
_MAX_SIZE_BITS = 1 << 17
# Functions whose work grows with their argument's value: n!, binomials, gamma, Fibonacci numbers, ...
_COUNTING_MODULES = ("sympy.functions.combinatorial", "sympy.functions.special.gamma_functions")
# latex2sympy's ANTLR parse time grows steeply with nesting (measured on 2 cores: x^x^...^2 20 deep 11 s,
# x^{x^{...}} 20 deep 1.5 s, 50 nested parentheses 5 s); real answers nest a few levels.
_MAX_NESTING = 12
_NESTING_STEP = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}
_POWER_CHAIN_RE = re.compile(r"(?:\^\s*\{?\s*[\w\\]*\s*){8,}")  # 8 or more powers in a row
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_LATEX_DELIMITER_RE = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
_PLAIN_NUMBER_RE = re.compile(r"^\s*[-+]?[\d.,\s]*\d[\d.,\s]*%?\s*$")

ANSWER_EXTRACTORS: Registry[Callable[[str], str | None]] = Registry("math answer extraction")


def find_boxed(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}` in `text`, in order, with nested braces kept.

    One pass with a stack of open braces (linear in len(text)); an unclosed box is skipped."""
    openers = {m.end() - 1: m.end() for m in _BOXED_RE.finditer(text)}  # "{" position -> content start
    stack: list[int] = []
    found: list[tuple[int, str]] = []
    for i, char in enumerate(text):
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            opened = stack.pop()
            if opened in openers:
                found.append((opened, text[openers[opened] : i]))
    return [content for _, content in sorted(found)]


def _hash_answers(text: str) -> list[str]:
    return [answer.strip() for answer in _HASH_RE.findall(text) if answer.strip()]


@ANSWER_EXTRACTORS.register("auto")
def extract_auto(text: str) -> str | None:
    """The text itself: Math-Verify finds the answer (boxed, LaTeX, "answer:", else the last number)."""
    return text


@ANSWER_EXTRACTORS.register("boxed")
def extract_boxed(text: str) -> str | None:
    """The last `\\boxed{...}`, still boxed (Math-Verify reads the box's content as LaTeX)."""
    boxed = find_boxed(text)
    return f"\\boxed{{{boxed[-1]}}}" if boxed else None


@ANSWER_EXTRACTORS.register("hash")
def extract_hash(text: str) -> str | None:
    """What follows the last `####` (GSM8K's answer line, arXiv:2110.14168)."""
    answers = _hash_answers(text)
    return answers[-1] if answers else None


@ANSWER_EXTRACTORS.register("last_line")
def extract_last_line(text: str) -> str | None:
    """The last non-empty line."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def reference_answer(example: dict[str, Any], key: str = "answer") -> str:
    """The reference answer of an example as Math-Verify should read it: a GSM8K-style "... #### 72" is
    reduced to "72"; bare LaTeX (MATH's "3\\sqrt{2}", "(1, 2)", "y = 2x + 3") is put in `$...$`, which
    unread would be taken for its plain numbers (3, 2, 3); a plain number ("1,234", "1,5") stays as is."""
    answer = str(example[key])
    hashes = _hash_answers(answer)
    answer = hashes[-1] if hashes else answer
    if _LATEX_DELIMITER_RE.search(answer) or _PLAIN_NUMBER_RE.match(answer):
        return answer
    return f"${answer.strip()}$"


def _number_bits(expr: Any) -> tuple[float, float]:
    """(size, magnitude) of a sympy number: bits to hold it exactly, an upper bound on log2 |value|."""
    if isinstance(expr, Float):
        exponent = float(expr._mpf_[2] + expr._mpf_[3]) if expr._mpf_[1] else 0.0
        return max(abs(exponent), 1.0), max(exponent, 0.0)
    p, q = abs(expr.p).bit_length(), expr.q.bit_length()
    return float(max(p, q, 1)), float(max(p - q + 1, 0))


def _bits(expr: Any) -> tuple[float, float]:
    """(size, magnitude) bounds, in bits, of the numbers sympy may build from `expr` (a symbol is 1):
    b^e holds size(b) * |e| bits with |e| < 2^magnitude(e); a product adds bits."""
    if isinstance(expr, Integer | Rational | Float):
        return _number_bits(expr)
    children = expr.args if isinstance(expr, Basic) else tuple(expr) if hasattr(expr, "__iter__") else ()
    bits = [_bits(child) for child in children if not isinstance(child, str)]
    if isinstance(expr, Pow):
        grown = math.inf if bits[1][1] > 64 else bits[0][0] * 2.0 ** bits[1][1]
        return grown, grown
    if isinstance(expr, Sum | Product) or (type(expr).__module__ or "").startswith(_COUNTING_MODULES):
        largest = max((b[1] for b in bits), default=1.0)  # n! < 2^(n log2 n); n terms of a sum
        grown = math.inf if largest > 64 else 2.0**largest * max(largest, 1.0)
        return grown, grown
    if isinstance(expr, Mul):
        return sum(b[0] for b in bits), sum(b[1] for b in bits)
    carry = math.log2(len(bits)) if isinstance(expr, Add) else 0.0
    return max((b[0] for b in bits), default=1.0) + carry, max((b[1] for b in bits), default=1.0) + carry


def _is_bounded(expr: Any) -> bool:
    try:
        return _bits(expr)[0] <= _MAX_SIZE_BITS
    except RecursionError:  # nesting deeper than the interpreter's stack: not an answer worth grading
        return False


def _too_nested(text: str) -> bool:
    """True for text whose parse would take long: brackets nested deeper than _MAX_NESTING, power chains."""
    if _POWER_CHAIN_RE.search(text):
        return True
    depth = 0
    for char in text:
        depth = max(depth + _NESTING_STEP.get(char, 0), 0)
        if depth > _MAX_NESTING:
            return True
    return False


class _ThreadDeadline:
    """Raises TimeoutException in the entering thread from `seconds` after entry until the block ends (at
    its next bytecode; again every 0.1 s, as math-verify catches one per parse or comparison): SIGALRM's
    role for a thread that is not the main one. Long C calls (big-integer arithmetic) finish first:
    `_bits` keeps those out."""

    def __init__(self, seconds: float):
        self._seconds, self._thread_id = seconds, 0
        self._stop, self._lock = threading.Event(), threading.Lock()

    def _set_async_exc(self, exc: type[BaseException] | None) -> None:
        # The documented C-API call; None (NULL) clears a pending exception.
        arg = ctypes.py_object(exc) if exc is not None else None
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), arg)

    def _watch(self) -> None:
        wait = self._seconds
        while not self._stop.wait(wait):
            with self._lock:
                if not self._stop.is_set():
                    self._set_async_exc(TimeoutException)
            wait = 0.1

    def __enter__(self) -> None:
        self._thread_id = threading.get_ident()
        threading.Thread(target=self._watch, daemon=True, name="rljax-math-deadline").start()

    def __exit__(self, *exc: object) -> None:
        while True:  # an exception set just before we hold the lock may land here: stop, clear, retry
            try:
                with self._lock:
                    self._stop.set()
                    self._set_async_exc(None)
                return
            except TimeoutException:
                continue


def grade_answer(
    answer: str, reference: str, *, float_rounding: int = 6, strict: bool = True, timeout_s: float = 2
) -> bool:
    """True if Math-Verify finds `answer` equal to `reference` (both free text, parsed with `_TARGETS`).

    `timeout_s` (rounded up to whole seconds: signal.alarm) bounds each parse and comparison with SIGALRM
    in a main thread; off it, where signals cannot be used, math-verify's timeouts are off and
    `_ThreadDeadline` bounds the whole at 3 * timeout_s. In a main thread `_ThreadDeadline` is the
    backstop, one second after the three alarms would have fired: an alarm can be lost (SIGALRM blocked
    or its timer re-armed by other code in the process; seen once in a long-lived test worker, where a
    symbolic determinant then ran for minutes).
    """
    in_main = threading.current_thread() is threading.main_thread()
    timeout = max(1, math.ceil(timeout_s)) if in_main else None
    try:
        with _ThreadDeadline(3 * timeout + 1 if in_main else 3 * timeout_s):
            if _too_nested(answer):
                return False
            gold = parse(reference, _TARGETS, parsing_timeout=timeout)
            predicted = parse(answer, _TARGETS, parsing_timeout=timeout)
            if not gold or not predicted or not all(_is_bounded(p) for p in predicted):
                return False
            return verify(
                gold, predicted, float_rounding=float_rounding, strict=strict, timeout_seconds=timeout
            )
    except TimeoutException:  # a BaseException: from _ThreadDeadline, or an alarm's race in math-verify
        return False


def _math_range(options: dict[str, Any]) -> tuple[float, float]:
    ANSWER_EXTRACTORS.get(options["extract"])  # an unknown name fails when the pool is built, not per call
    return min(options["correct"], options["incorrect"]), max(options["correct"], options["incorrect"])


@REWARDS.register("math")
@declare_range(_math_range)
def math_reward(
    *,
    prompt: str,
    completion: str,
    example: dict[str, Any],
    answer_key: str = "answer",
    correct: float = 1.0,
    incorrect: float = 0.0,
    extract: str = "auto",
    float_rounding: int = 6,
    strict: bool = True,
    timeout_s: float = 2,
    max_chars: int = 4096,
) -> float:
    """`correct` if the completion's final answer equals example[answer_key] (Math-Verify), else `incorrect`.

    extract: a name in ANSWER_EXTRACTORS (auto, boxed, hash, last_line), applied to the completion's last
    `max_chars` characters. float_rounding, strict: `math_verify.verify`'s (decimals compared; whether
    variable names and set-vs-tuple matter). timeout_s: per parse or comparison in a main thread, 3x for
    the whole call off it (see `grade_answer`).
    References: Math-Verify (Hugging Face, github.com/huggingface/Math-Verify); GSM8K answer format
    (Cobbe et al. 2021, arXiv:2110.14168); `\\boxed{}` convention of MATH (Hendrycks et al. 2021,
    arXiv:2103.03874).
    """
    answer = ANSWER_EXTRACTORS.get(extract)(completion[-max_chars:])
    if answer is None:
        return incorrect
    reference = reference_answer(example, answer_key)
    ok = grade_answer(answer, reference, float_rounding=float_rounding, strict=strict, timeout_s=timeout_s)
    return correct if ok else incorrect


_FORMATS = {
    "hash": re.compile(r"(?m)^\s*####\s*\S"),
    "answer": re.compile(r"(?i)answer\s*:\s*\S"),
    "think": re.compile(r"(?s)<think>.+?</think>"),
}


@REWARDS.register("format")
@declare_range(lambda o: (min(o["reward"], o["penalty"]), max(o["reward"], o["penalty"])))
def format_reward(
    *,
    prompt: str,
    completion: str,
    example: dict[str, Any],
    kind: str = "boxed",
    regex: str | None = None,
    reward: float = 1.0,
    penalty: float = 0.0,
) -> float:
    """`reward` if the completion contains the required pattern, else `penalty`.

    `kind` is "boxed" (a non-empty `\\boxed{...}`), "hash" (a `#### x` line), "answer" ("Answer: x") or
    "think" (`<think>...</think>`); a `regex` (searched with re.DOTALL) overrides `kind`.
    References: DeepSeek-R1 format reward (DeepSeek-AI 2025, arXiv:2501.12948).
    """
    if regex is not None:
        present = re.search(regex, completion, re.DOTALL) is not None
    elif kind == "boxed":
        present = any(b.strip() for b in find_boxed(completion))
    elif kind in _FORMATS:
        present = _FORMATS[kind].search(completion) is not None
    else:
        valid = ", ".join(["boxed", *_FORMATS])
        raise ValueError(f"unknown format kind {kind!r}; valid: {valid} (or pass regex=)")
    return reward if present else penalty
