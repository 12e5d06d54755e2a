"""The YAML of rendered Kubernetes manifests, written and read back without a YAML library.

`dump(documents)` writes block-style YAML in which every string is a JSON-quoted scalar (so `"true"`,
`"0600"` or `"1"` stay strings: a value never changes type on the way through kubectl, kustomize or
PyYAML), and `load(text)` reads exactly that subset back (mappings, lists, JSON scalars, `---` between
documents, `#` comment lines). The manifests are the contract between the renderer and the `k8s-local`
rehearsal, so the rehearsal reads the files, not the objects that produced them.
"""

from __future__ import annotations

import json
import re

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")  # a mapping key written without quotes


def _key(key: str) -> str:
    return key if _PLAIN_KEY.fullmatch(key) else json.dumps(key)


def _scalar(value) -> str:
    if isinstance(value, (dict, list)):  # only empty ones are written inline
        return "{}" if isinstance(value, dict) else "[]"
    return json.dumps(value)


def _lines(value, indent: int) -> list[str]:
    pad, out = " " * indent, []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                out += [f"{pad}{_key(key)}:", *_lines(item, indent + 2)]
            else:
                out.append(f"{pad}{_key(key)}: {_scalar(item)}")
    else:
        for item in value:
            if isinstance(item, (dict, list)) and item:
                first, *rest = _lines(item, indent + 2)
                out += [f"{pad}- {first.lstrip()}", *rest]
            else:
                out.append(f"{pad}- {_scalar(item)}")
    return out


def dump(documents: list[dict], header: str = "") -> str:
    """`documents` as YAML, `---` between them, after `header` (comment lines)."""
    comments = [f"# {line}".rstrip() for line in header.splitlines()]
    body = "\n---\n".join("\n".join(_lines(doc, 0)) for doc in documents)
    return "\n".join([*comments, body]) + "\n"


def _split_key(content: str) -> tuple[str, str]:
    """(key, the rest after `key:`) of one mapping line."""
    if content.startswith('"'):
        key, end = json.JSONDecoder().raw_decode(content)
        rest = content[end:]
    else:
        key, sep, rest = content.partition(":")
        rest = sep + rest
    if not rest.startswith(":"):
        raise ValueError(f"not a mapping line: {content!r}")
    return key, rest[1:].strip()


def _is_scalar(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _block(lines: list[tuple[int, str]], i: int, indent: int):
    """(the mapping or list starting at line `i`, indented `indent`; the index of the line after it)."""
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        items = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("-"):
            rest = lines[i][1][1:].lstrip()
            if _is_scalar(rest):
                items.append(json.loads(rest))
                i += 1
            else:  # `- key: ...`: a mapping whose first line shares the dash's line
                lines[i] = (indent + 2, rest)
                item, i = _block(lines, i, indent + 2)
                items.append(item)
        return items, i
    mapping = {}
    while i < len(lines) and lines[i][0] == indent:
        key, rest = _split_key(lines[i][1])
        i += 1
        if rest:
            mapping[key] = json.loads(rest)
        elif i < len(lines) and lines[i][0] > indent:
            mapping[key], i = _block(lines, i, lines[i][0])
        else:
            raise ValueError(f"no value for {key!r}")
    return mapping, i


def load(text: str) -> list[dict]:
    """The documents of YAML written by `dump`; ValueError on anything else."""
    documents = []
    for part in re.split(r"^---\s*$", text, flags=re.M):
        lines = [
            (len(line) - len(line.lstrip(" ")), line.strip())
            for line in part.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if lines:
            doc, end = _block(lines, 0, lines[0][0])
            if end != len(lines):
                raise ValueError(f"unexpected indentation at {lines[end][1]!r}")
            documents.append(doc)
    return documents
