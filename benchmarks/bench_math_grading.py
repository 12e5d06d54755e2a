"""Agreement of the `math` reward with Math-Verify's own labelled test cases, old grader vs new.

The labelled cases are the `(gold, pred, expected)` parametrizations in the tests of the math-verify sdist
(tests/test_*.py; parsed with `ast`, never imported or run). Each case is graded three ways, a verdict
agreeing when it equals the label:
  old:       the hand-written extractor + numeric comparator that was the `math` reward up to commit
             d4b06cb (copied below as the baseline, with its default last-number fallback);
  new:       `rljax.rewards.math_verify.math_reward` with its defaults, plus `float_rounding` and `strict`
             where a test sets them (`match_types` and `allow_set_relation_comp` it has no option for);
  reference: math-verify called exactly as the test calls it: checks that the cases were read right.
Prints total and per-file agreement, and whether the old grader's acceptances are a subset of the new's.
`--write-cases` writes tests/rewards/math_verify_cases.json: the cases whose settings the reward's options
can express (`compare_strings` with LaTeX + expression extraction, no set-relation comparison).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_math_grading.py [--sdist math_verify-0.9.0.tar.gz]
        [--json out.json] [--write-cases tests/rewards/math_verify_cases.json]
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import math
import re
import subprocess
import sys
import tarfile
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rljax.rewards.math_verify import find_boxed, math_reward

LICENSE_NOTE = (
    "Labelled cases from the tests of math-verify {version} (Hugging Face, "
    "github.com/huggingface/Math-Verify; Apache-2.0 license), files tests/{files}: (gold, pred, "
    "expected) as parametrized there; float_rounding and strict are the test's own settings. "
    "Written by benchmarks/bench_math_grading.py --write-cases."
)

# ---- The old grader (rljax/rewards/math_verify.py at d4b06cb), the baseline; unchanged but unregistered.
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


def old_extract_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
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


def _old_normalize(s: str) -> str:
    s = s.strip().replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _TEXT_RE.sub(r"\1", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    return s.strip().rstrip(".").strip()


def _old_to_fraction(s: str) -> Fraction | None:
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
    num_f, den_f = _old_to_fraction(num), _old_to_fraction(den)
    if num_f is None or den_f is None or den_f == 0:
        return None
    value = num_f / den_f
    return -value if sign == "-" else value


def old_parse_number(text: str) -> list[Fraction]:
    s = _old_normalize(text)
    if "=" in s:
        s = s.rsplit("=", 1)[1].strip()
    percent = s.endswith("%")
    s = s.removesuffix("\\%").removesuffix("%").strip()
    value = _old_to_fraction(s)
    if value is None:
        numbers = _NUMBER_IN_TEXT_RE.findall(s)
        words_only = len(numbers) == 1 and _WORDS_RE.match(s.replace(numbers[0], " ", 1))
        value = _old_to_fraction(numbers[0]) if words_only else None
    if value is None:
        return []
    return [value, value / 100] if percent else [value]


def old_answers_match(predicted: str, reference: str, *, rel_tol: float = 1e-9) -> bool:
    pred_values, ref_values = old_parse_number(predicted), old_parse_number(reference)
    if pred_values and ref_values:
        for p in pred_values:
            for r in ref_values:
                if p == r or abs(p - r) <= rel_tol * max(abs(p), abs(r)):
                    return True
        return False
    squash = lambda s: _old_normalize(s).replace(" ", "").lower()  # noqa: E731 - verbatim baseline
    return bool(squash(predicted)) and squash(predicted) == squash(reference)


def old_math_reward(*, completion: str, example: dict[str, Any], fallback_last_number: bool = True) -> float:
    answer = str(example["answer"])
    if not old_parse_number(answer):
        answer = old_extract_answer(answer, fallback_last_number=False) or answer
    predicted = old_extract_answer(completion, fallback_last_number=fallback_last_number)
    return float(predicted is not None and old_answers_match(predicted, answer))


# ---- Reading the labelled cases out of the sdist's tests.
def _literal_keywords(call: ast.Call) -> dict[str, Any]:
    """The call's keyword arguments: literals as values, a parameter name as {"param": name}."""
    out = {}
    for keyword in call.keywords:
        if isinstance(keyword.value, ast.Name):
            out[keyword.arg] = {"param": keyword.value.id}
        else:
            out[keyword.arg] = ast.literal_eval(keyword.value)
    return out


def _grader_call(fn: ast.FunctionDef) -> tuple[str, dict[str, Any]] | None:
    """("compare_strings", its keywords) or ("parse_verify", {}) for a test that grades (gold, pred)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "compare_strings":
                return "compare_strings", _literal_keywords(node)
            if node.func.id == "verify" and all(isinstance(a, ast.Call) for a in node.args[:2]):
                return "parse_verify", {}
    return None


_F_STRING_NODES = (ast.JoinedStr, ast.FormattedValue, ast.Constant, ast.Call, ast.Attribute, ast.Load)


def _value(node: ast.expr) -> Any:
    """A literal, or an f-string of `math.f(constants)` (test_all.py's f"{math.sqrt(17):.15f}")."""
    if isinstance(node, ast.Tuple):
        return tuple(_value(element) for element in node.elts)
    if isinstance(node, ast.JoinedStr):
        parts = list(ast.walk(node))
        names = {n.id for n in parts if isinstance(n, ast.Name)}
        if names <= {"math"} and all(isinstance(n, (*_F_STRING_NODES, ast.Name)) for n in parts):
            code = compile(ast.Expression(node), "<case>", "eval")
            return eval(code, {"__builtins__": {}, "math": math})  # noqa: S307 - checked: math calls only
    return ast.literal_eval(node)


def _cases_of_test(file: str, fn: ast.FunctionDef) -> list[dict[str, Any]]:
    grader = _grader_call(fn)
    cases = []
    for deco in fn.decorator_list:
        if not (isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize"):
            continue
        names = [n.strip() for n in ast.literal_eval(deco.args[0]).split(",")]
        if grader is None or not {"gold", "pred"} <= set(names):
            continue
        label = "expected" if "expected" in names else "result"
        for element in deco.args[1].elts:
            row = dict(zip(names, _value(element), strict=True))
            kind, keywords = grader
            settings = {k: row[v["param"]] if isinstance(v, dict) else v for k, v in keywords.items()}
            case = {"file": file, "test": fn.name, "gold": row["gold"], "pred": row["pred"]}
            cases.append({**case, "expected": bool(row[label]), "grader": kind, **settings})
    return cases


def read_cases(sdist: Path) -> tuple[str, list[dict[str, Any]]]:
    """(version, labelled cases) from an sdist .tar.gz or its unpacked directory."""
    sources: dict[str, str] = {}
    if sdist.is_dir():
        root = next(sdist.glob("**/tests")).parent
        sources = {p.name: p.read_text() for p in sorted(root.glob("tests/test_*.py"))}
    else:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if re.search(r"/tests/test_[^/]*\.py$", member.name):
                    sources[Path(member.name).name] = tar.extractfile(member).read().decode()
        root = Path(sdist.name.removesuffix(".tar.gz"))
    version = root.name.rpartition("-")[2]
    cases = []
    for file, source in sorted(sources.items()):
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                cases.extend(_cases_of_test(file, node))
    return version, cases


def download_sdist(directory: str) -> Path:
    version = importlib.metadata.version("math-verify")
    command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", directory]
    subprocess.run([*command, f"math-verify=={version}"], check=True, capture_output=True)
    return next(Path(directory).glob("math_verify-*.tar.gz"))


# ---- Grading.
def reference_verdict(case: dict[str, Any]) -> bool:
    """math-verify as the test calls it (tests/test_all.py:compare_strings, or parse + verify)."""
    if case["grader"] == "parse_verify":
        return verify(parse(case["gold"]), parse(case["pred"]))
    match_types = case.get("match_types", ["latex", "expr"])
    targets = [LatexExtractionConfig(boxed_match_priority=0)] if "latex" in match_types else []
    targets += [ExprExtractionConfig()] if "expr" in match_types else []
    gold, pred = parse(case["gold"], targets), parse(case["pred"], targets)
    return verify(gold, pred, float_rounding=case.get("precision", 6), strict=case.get("strict", True),
                  allow_set_relation_comp=case.get("allow_set_relation_comp", False))  # fmt: skip


def reward_options(case: dict[str, Any]) -> dict[str, Any]:
    """The `math` reward options that express the test's settings (the ones it has an option for)."""
    return {"float_rounding": case.get("precision", 6), "strict": case.get("strict", True)}


def new_verdict(case: dict[str, Any]) -> bool:
    example = {"answer": case["gold"]}
    return math_reward(prompt="", completion=case["pred"], example=example, **reward_options(case)) == 1.0


def old_verdict(case: dict[str, Any]) -> bool:
    return old_math_reward(completion=case["pred"], example={"answer": case["gold"]}) == 1.0


def expressible(case: dict[str, Any]) -> bool:
    """The reward's options can state the test's settings (LaTeX + expression extraction, boxed first)."""
    extraction = case.get("match_types", ["latex", "expr"]) == ["latex", "expr"]
    return case["grader"] == "compare_strings" and extraction and not case.get("allow_set_relation_comp")


def grade_all(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**c, "old": old_verdict(c), "new": new_verdict(c), "ref": reference_verdict(c)} for c in cases]


# ---- Reporting.
def agreement(rows: list[dict[str, Any]], key: str) -> str:
    agree = sum(r[key] == r["expected"] for r in rows)
    return f"{agree}/{len(rows)} ({agree / max(len(rows), 1):.1%})"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Agreement per grader, total / per file / expressible cases, and the subset check."""
    groups = {"total": rows, "expressible": [r for r in rows if expressible(r)]}
    for file in sorted({r["file"] for r in rows}):
        groups[file] = [r for r in rows if r["file"] == file]
    table = {
        name: {
            "cases": len(g),
            "positive": sum(r["expected"] for r in g),
            **{k: agreement(g, k) for k in ("old", "new", "ref")},
        }
        for name, g in groups.items()
    }
    old_only = [r for r in rows if r["old"] and not r["new"]]
    subset = {
        "old_accepts": sum(r["old"] for r in rows),
        "old_accepts_wrong": sum(r["old"] and not r["expected"] for r in rows),
        "new_accepts_wrong": sum(r["new"] and not r["expected"] for r in rows),
        "old_accepts_new_rejects": len(old_only),
        "of_which_labelled_wrong": sum(not r["expected"] for r in old_only),
        "old_is_subset_of_new": not old_only,
    }
    return {"agreement": table, "subset": subset}


def print_report(version: str, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"math-verify {version} labelled cases; agreement with the label (old / new / reference)")
    print(f"{'group':28s} {'cases':>5s} {'pos':>4s}  {'old':>16s} {'new':>16s} {'reference':>16s}")
    for name, t in summary["agreement"].items():
        verdicts = " ".join(f"{t[k]:>16s}" for k in ("old", "new", "ref"))
        print(f"{name:28s} {t['cases']:5d} {t['positive']:4d}  {verdicts}")
    print("subset check:", json.dumps(summary["subset"]))
    print("old accepts a wrong answer that the new grader rejects, e.g.:")
    for r in [r for r in rows if r["old"] and not r["expected"] and not r["new"]][:8]:
        print(f"  {r['file']}:{r['test']}: gold {r['gold'][:50]!r} pred {r['pred'][:50]!r}")


def vendored_cases(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The expressible cases (a test can check the reward on them with the reward's own options)."""
    keys = ("file", "test", "gold", "pred", "expected")
    return [{**{k: r[k] for k in keys}, **reward_options(r)} for r in rows if expressible(r)]


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument(
        "--sdist", type=Path, help="math-verify sdist (.tar.gz or dir); default: pip download"
    )
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--write-cases", type=Path, help="write the vendored subset here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        version, cases = read_cases(args.sdist or download_sdist(tmp))
    rows = grade_all(cases)
    summary = summarize(rows)
    print_report(version, summary, rows)
    if args.json:
        args.json.write_text(json.dumps({"version": version, **summary}, indent=1))
    if args.write_cases:
        subset = vendored_cases(rows)
        files = ", ".join(sorted({c["file"] for c in subset}))
        note = LICENSE_NOTE.format(version=version, files=files)
        text = json.dumps({"source": note, "cases": subset}, indent=1, ensure_ascii=False)
        args.write_cases.write_text(text + "\n")
        positive = sum(c["expected"] for c in subset)
        print(f"wrote {len(subset)} cases ({positive} positive) to {args.write_cases}")


if __name__ == "__main__":
    main()
