"""Math answer verification: extract a final answer, compare it numerically with the reference.

Extraction order: the last `\\boxed{...}` (nested braces), the last `#### answer` line, the last
"answer is X" / "Answer: X", and finally the last number in the text. Numeric equivalence is exact
(fractions) for integers, decimals, `a/b`, `\\frac{a}{b}` and thousands separators, and a percentage
matches both its value and its value / 100.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from rljax.rewards.base import REWARDS, declare_range

_NUM = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d+)?|[+-]?\.\d+(?:[eE][+-]?\d+)?"
_NUM_RE = re.compile(rf"^(?:{_NUM})$")
_FRACTION_RE = re.compile(rf"^({_NUM})/({_NUM})$")
_LATEX_FRAC_RE = re.compile(r"^([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_LATEX_FRAC_SHORT_RE = re.compile(r"^([+-]?)\\frac(\d)(\d)$")
_NUMBER_IN_TEXT_RE = re.compile(rf"(?<![\w.])(?:{_NUM})(?:/\d+)?")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_RE = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
_WORDS_RE = re.compile(r"^[A-Za-z\s]*$")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "~", "^\\circ", "^{\\circ}")


def find_boxed(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}` in `text`, in order, with nested braces kept."""
    found = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def extract_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """The final answer in a completion (see module docstring for the order), or None."""
    boxed = find_boxed(text)
    if boxed:
        return boxed[-1].strip()
    hashes = _HASH_RE.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    answers = _ANSWER_RE.findall(text)
    if answers:
        return answers[-1].strip().rstrip(".")
    if fallback_last_number:
        numbers = _NUMBER_IN_TEXT_RE.findall(text)
        if numbers:
            return numbers[-1]
    return None


def _normalize(s: str) -> str:
    s = s.strip().replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _TEXT_RE.sub(r"\1", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    return s.strip().rstrip(".").strip()


def _to_fraction(s: str) -> Fraction | None:
    s = s.replace(" ", "")
    if _NUM_RE.match(s):
        return Fraction(s.replace(",", ""))
    match = _FRACTION_RE.match(s) or _LATEX_FRAC_RE.match(s) or _LATEX_FRAC_SHORT_RE.match(s)
    if match is None:
        return None
    if match.re is _FRACTION_RE:
        sign, num, den = "", match.group(1), match.group(2)
    else:
        sign, num, den = match.groups()
    num_f, den_f = _to_fraction(num), _to_fraction(den)
    if num_f is None or den_f is None or den_f == 0:
        return None
    value = num_f / den_f
    return -value if sign == "-" else value


def parse_number(text: str) -> list[Fraction]:
    """Numeric readings of an answer string (empty if it is not a number).

    "3/4", "\\frac{3}{4}", "0.75", "1,234", "-5", "x = 5", "$18.00", "50\\%" (-> [50, 1/2]) are numbers.
    """
    s = _normalize(text)
    if "=" in s:
        s = s.rsplit("=", 1)[1].strip()
    percent = s.endswith("%")
    s = s.removesuffix("\\%").removesuffix("%").strip()
    value = _to_fraction(s)
    if value is None:
        # Only words around a single number ("18 dollars", "about 7"): use that number; "x+1" is no number.
        numbers = _NUMBER_IN_TEXT_RE.findall(s)
        words_only = len(numbers) == 1 and _WORDS_RE.match(s.replace(numbers[0], " ", 1))
        value = _to_fraction(numbers[0]) if words_only else None
    if value is None:
        return []
    return [value, value / 100] if percent else [value]


def answers_match(predicted: str, reference: str, *, rel_tol: float = 1e-9) -> bool:
    """True if two answer strings are numerically equal (within `rel_tol`) or equal as normalized text."""
    pred_values, ref_values = parse_number(predicted), parse_number(reference)
    if pred_values and ref_values:
        for p in pred_values:
            for r in ref_values:
                if p == r or abs(p - r) <= rel_tol * max(abs(p), abs(r)):
                    return True
        return False
    squash = lambda s: _normalize(s).replace(" ", "").lower()
    return bool(squash(predicted)) and squash(predicted) == squash(reference)


def reference_answer(example: dict[str, Any], key: str = "answer") -> str:
    """The reference answer of an example; a GSM8K-style "... #### 72" or boxed reference is reduced to 72."""
    answer = str(example[key])
    if parse_number(answer):
        return answer
    return extract_answer(answer, fallback_last_number=False) or answer


@REWARDS.register("math")
@declare_range(lambda o: (min(o["correct"], o["incorrect"]), max(o["correct"], o["incorrect"])))
def math_reward(
    *,
    prompt: str,
    completion: str,
    example: dict[str, Any],
    answer_key: str = "answer",
    correct: float = 1.0,
    incorrect: float = 0.0,
    fallback_last_number: bool = True,
    rel_tol: float = 1e-9,
) -> float:
    """`correct` if the completion's final answer equals example[answer_key], else `incorrect`.

    References: GSM8K answer format (Cobbe et al. 2021, arXiv:2110.14168); `\\boxed{}` convention of
    MATH (Hendrycks et al. 2021, arXiv:2103.03874).
    """
    predicted = extract_answer(completion, fallback_last_number=fallback_last_number)
    if predicted is None:
        return incorrect
    ok = answers_match(predicted, reference_answer(example, answer_key), rel_tol=rel_tol)
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
