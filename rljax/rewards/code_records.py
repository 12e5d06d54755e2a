"""The sandbox's probe records, read in the trusted process: one JSON line per probe, decoded to plain data.

`read_probes(stdout, n)` -> {probe id: value}; `decode` inverts `_code_harness._encode` (containers tagged,
anything without a plain-data form an `_Opaque` that equals nothing).
"""

from __future__ import annotations

import json
from typing import Any


class _Opaque:
    """A sandbox value of a type with no plain-data form: it equals nothing and has no truth value."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __bool__(self) -> bool:
        raise TypeError(f"{self.type_name} has no plain-data truth value")


def decode(data: Any, depth: int = 0) -> Any:
    """The plain value of one JSON-encoded probe result (inverse of `_code_harness._encode`)."""
    if depth > 64:
        raise ValueError("value nested too deeply")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = data.items()
    builders = {"l": list, "t": tuple, "s": set, "f": frozenset}
    if tag in builders and type(body) is list:
        return builders[tag](decode(x, depth + 1) for x in body)
    if tag == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(*body)
    if tag == "o" and type(body) is str:
        return _Opaque(body)
    raise ValueError(f"malformed value tag {tag!r}")


def read_probes(stdout: str, num_probes: int) -> dict[int, Any]:
    """{probe id: value} from the sandbox's record lines; a probe reported twice, or as an error, has none."""
    seen: dict[int, int] = {}
    values: dict[int, Any] = {}
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
            probe_id = record["i"]
            if (
                type(probe_id) is not int
                or not 0 <= probe_id < num_probes
                or set(record) not in ({"i", "v"}, {"i", "e"})
            ):
                continue
            seen[probe_id] = seen.get(probe_id, 0) + 1
            if "v" in record:
                values[probe_id] = decode(record["v"])
        except Exception:  # noqa: BLE001 - not a record (or a malformed one): it counts nothing
            continue
    return {i: v for i, v in values.items() if seen[i] == 1}
