"""Example sources: the `SOURCES` registry and the file-backed ones (jsonl, parquet, hf_datasets).

Every source returns a list of examples: dicts with at least "prompt" (a str, or a conversation: a list
of {"role", "content"} messages, rendered with `data.chat_template=true`) and "answer" (str), plus
whatever other fields the record has. `fields` maps our names to the record's ones, e.g.
{"prompt": "question", "answer": "final"}; a dotted name ("meta.answer") reads a nested field.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

from rljax.data.chat import check_prompt
from rljax.registry import Registry

Example = dict[str, Any]
SOURCES: Registry[Callable[..., list[Example]]] = Registry("data source")
REQUIRED = ("prompt", "answer")


def make_source(name: str, **options: Any) -> list[Example]:
    """Builds the examples of source `name` (a key of SOURCES) with its options; deterministic given them."""
    return SOURCES.get(name)(**options)


def _lookup(record: dict[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def map_fields(
    records: Iterable[dict[str, Any]],
    fields: dict[str, str] | None,
    *,
    where: str,
    require_answer: bool = True,
    limit: int | None = None,
) -> list[Example]:
    """Applies the field mapping to each record (a mapped name beyond prompt/answer just adds a field) and
    checks the required fields; errors name `where` and the record number."""
    fields = dict(fields or {})
    examples = []
    for n, record in enumerate(records):
        if limit is not None and n >= limit:
            break
        if not isinstance(record, dict):
            raise ValueError(f"{where} record {n}: expected an object, got {type(record).__name__}")
        example = dict(record)
        for ours, theirs in fields.items():
            try:
                example[ours] = _lookup(record, theirs)
            except KeyError:
                raise KeyError(
                    f"{where} record {n}: field {theirs!r} (mapped to {ours!r}) not found; "
                    f"record has {sorted(record)}"
                ) from None
        if not require_answer:
            example.setdefault("answer", "")
        missing = [k for k in REQUIRED if k not in example]
        if missing:
            hint = f"; map them with fields={{{', '.join(repr(k) + ': ...' for k in missing)}}}"
            raise KeyError(f"{where} record {n}: missing {missing}; record has {sorted(record)}{hint}")
        example["prompt"] = check_prompt(example["prompt"], f"{where} record {n}")
        example["answer"] = str(example["answer"])
        examples.append(example)
    return examples


def _read_jsonl(path: pathlib.Path) -> Iterable[dict[str, Any]]:
    with path.open() as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: invalid JSON: {e}") from None


@SOURCES.register("jsonl")
def jsonl_source(
    *, path: str, fields: dict[str, str] | None = None, limit: int | None = None, require_answer: bool = True
) -> list[Example]:
    """One example per non-empty line of a JSON Lines file."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"jsonl source: no file at {path!r}")
    return map_fields(_read_jsonl(p), fields, where=str(p), require_answer=require_answer, limit=limit)


@SOURCES.register("parquet")
def parquet_source(
    *, path: str, fields: dict[str, str] | None = None, limit: int | None = None, require_answer: bool = True
) -> list[Example]:
    """One example per row of a Parquet file or directory of files (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("parquet source needs pyarrow: pip install 'rljax[data]' (or pyarrow)") from e
    if not pathlib.Path(path).exists():
        raise FileNotFoundError(f"parquet source: nothing at {path!r}")
    rows = pq.read_table(path).to_pylist()
    return map_fields(rows, fields, where=path, require_answer=require_answer, limit=limit)


@SOURCES.register("hf_datasets")
def hf_datasets_source(
    *,
    path: str,
    split: str | None = None,
    fields: dict[str, str] | None = None,
    limit: int | None = None,
    require_answer: bool = True,
) -> list[Example]:
    """Rows of a local `datasets.save_to_disk` directory (a Dataset, or a DatasetDict with `split`)."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "hf_datasets source needs the `datasets` package: pip install 'rljax[data]' (or datasets)"
        ) from e
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise KeyError(f"hf_datasets {path!r} is a DatasetDict: pass split= one of {sorted(loaded)}")
        loaded = loaded[split]
    elif split is not None:
        raise ValueError(f"hf_datasets {path!r} is a single Dataset; it has no split {split!r}")
    return map_fields(iter(loaded), fields, where=path, require_answer=require_answer, limit=limit)
