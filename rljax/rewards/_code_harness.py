"""Sandbox side of the code reward's assert tests (stdlib only; runs as main.py after a `PAYLOAD = ...` line).

PAYLOAD = {"solution": str, "tests": [[["setup", src] | ["probe", id, src], ...], ...]}. It runs the
solution, then each test's steps in the solution's namespace, and writes one JSON line per probe to the
original stdout: {"i": id, "v": encoded value} or {"i": id, "e": exception type name}. The solution's own
prints go to stderr. Nothing here decides pass or fail: the trusted parent compares the values with
expected values that never enter the sandbox, so a solution that tampers with this file, its output or
the interpreter can at most choose its own answers (which is what a solution does anyway).
"""

import json
import os

# Why: bound before the solution runs (module globals shadow builtins), so a solution that rebinds builtins
# or module attributes does not change how honest values are encoded. JSON text is built here, with the
# C string escaper only: json.dumps runs Python code that looks builtins up at call time.
_escape, _write, compile, eval, exec = json.encoder.encode_basestring_ascii, os.write, compile, eval, exec
type, isinstance, hasattr, str, enumerate, print = type, isinstance, hasattr, str, enumerate, print
bool, int, float, list, tuple, set, frozenset = bool, int, float, list, tuple, set, frozenset
dict, bytes, complex, BaseException, ValueError = dict, bytes, complex, BaseException, ValueError
_OUT = os.dup(1)
os.dup2(2, 1)  # the solution's stdout (print, sys.stdout, fd 1) now goes to stderr
_MAX_DEPTH = 64
_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_FLOATS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _number(value):
    text = int.__repr__(value) if type(value) is int else float.__repr__(value)
    return _FLOATS[text] if text in _FLOATS else text


def _tagged(tag, items):
    return "{" + _escape(tag) + ": [" + ", ".join(items) + "]}"


def _encode(value, depth=0):
    """JSON text of plain data: scalars as themselves, containers tagged, anything else {"o": type name}."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool:
        return {None: "null", True: "true", False: "false"}[value]
    if kind is int or kind is float:
        return _number(value)
    if kind is str:
        return _escape(value)
    if kind in _TAGS:
        return _tagged(_TAGS[kind], [_encode(x, depth + 1) for x in value])
    if kind is dict:
        pairs = ["[" + _encode(k, depth + 1) + ", " + _encode(v, depth + 1) + "]" for k, v in value.items()]
        return _tagged("d", pairs)
    if kind is bytes:
        return "{" + _escape("b") + ": " + _escape(value.hex()) + "}"
    if kind is complex:
        return _tagged("c", [_number(value.real), _number(value.imag)])
    if (
        type(kind).__module__ == "builtins"
        and kind.__module__.startswith("numpy")
        and hasattr(value, "tolist")
    ):
        return _encode(value.tolist(), depth + 1)  # numpy arrays and scalars as the plain data they hold
    for base in (bool, int, float, str):  # subclasses (IntEnum, ...) as their base value
        if isinstance(value, base):
            plain = base(value)
            if type(plain) is base:
                return _encode(plain, depth + 1)
    return "{" + _escape("o") + ": " + _escape(str(kind.__name__)) + "}"


def _probe(namespace, probe_id, source):
    head = "{" + _escape("i") + ": " + int.__repr__(probe_id) + ", "
    try:
        line = (
            head
            + _escape("v")
            + ": "
            + _encode(eval(compile(source, f"probe_{probe_id}", "eval"), namespace))
        )
    except BaseException:  # noqa: BLE001 - a failing probe fails its test, whatever it raised
        line = head + _escape("e") + ": " + _escape("error")
    _write(_OUT, (line + "}\n").encode())


def _run(payload):
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(payload["solution"], "solution.py", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - sys.exit or a crash at import: the tests still run
        print("solution:", type(e).__name__, e)
    for test_index, steps in enumerate(payload["tests"]):
        for step in steps:
            if step[0] == "probe":
                _probe(namespace, step[1], step[2])
                continue
            try:
                exec(compile(step[1], f"test_{test_index}.py", "exec"), namespace)
            except BaseException as e:  # noqa: BLE001 - the rest of this test's probes stay missing
                print(f"test {test_index}:", type(e).__name__, e)
                break


_run(PAYLOAD)  # noqa: F821 - defined by the line the parent puts in front of this file
