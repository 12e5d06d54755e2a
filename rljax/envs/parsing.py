"""Qwen/Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_call(text)` looks at the first `<tool_call>` in `text` (the current assistant message) and
returns None when there is none (the turn is a final answer), a `ToolCall`, or a `MalformedCall` saying
what is wrong: unclosed tag, invalid JSON, not an object, missing or non-string "name", arguments that are
neither an object nor a JSON string of one. Hermes models sometimes emit "arguments" as a JSON-encoded
string; that form is accepted.

The text is the policy's: parsing it in the trainer's process is bounded. A call longer than
`MAX_CALL_CHARS` is malformed unparsed, and whatever the JSON decoder refuses (nesting past the recursion
limit, an integer of more than 4,300 digits) is a malformed call, never an exception out of the step.

References: Hermes function-calling format (NousResearch Hermes-2-Pro); Qwen2.5 chat template tool calls.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 16384  # a tool call's JSON; a few hundred characters in practice


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    reason: str


def _arguments(raw: Any) -> dict[str, Any] | str:
    """The arguments object, or a reason string when they are not one."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):  # JSONDecodeError, too many digits, too deep
            return "arguments is a string but not JSON"
    return raw if isinstance(raw, dict) else f"arguments must be an object, got {type(raw).__name__}"


def parse_tool_call(text: str) -> ToolCall | MalformedCall | None:
    """The first tool call in `text`; None when `text` has no `<tool_call>` tag."""
    start = text.find(OPEN)
    if start < 0:
        return None
    end = text.find(CLOSE, start)
    if end < 0:
        return MalformedCall(f"{OPEN} without {CLOSE}")
    body = text[start + len(OPEN) : end].strip()
    if len(body) > MAX_CALL_CHARS:
        return MalformedCall(f"a tool call longer than {MAX_CALL_CHARS} characters")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(f"invalid JSON: {e.msg} at char {e.pos}")
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit; nesting too deep
        return MalformedCall(f"invalid JSON: {type(e).__name__}: {str(e)[:80]}")
    if not isinstance(call, dict):
        return MalformedCall(f"a tool call must be a JSON object, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall('missing or non-string "name"')
    arguments = _arguments(call.get("arguments"))
    if isinstance(arguments, str):
        return MalformedCall(arguments)
    return ToolCall(name, arguments)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of a call (what a well-formed model turn contains)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CLOSE}"
