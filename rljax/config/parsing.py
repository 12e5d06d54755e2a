"""Config parsing: ConfigDict / dict / command-line overrides -> the typed `Config`, and back.

`configs/*.py` files build an `ml_collections.ConfigDict` from `default_config_dict()` and change a few
fields; `from_config_dict` turns the (possibly overridden) ConfigDict into frozen dataclasses, rejecting
unknown keys (with the closest valid names), removed keys (saying why), wrong types and values outside a
field's choices.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import typing
from typing import Any

import ml_collections

from rljax.config.schema import Config, ConfigError

# Fields that existed once and were removed: passing one is a one-line error saying why (not a silent no-op).
REMOVED_FIELDS = {
    "rollout.engine": "removed: vLLM is the only rollout engine",
    "rollout.vllm.port": "removed: owned servers each pick a free port; to use servers of your own, "
    "list them in rollout.vllm.urls",
}


def _fields(cls) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        f.type = hints[f.name]
        out[f.name] = f
    return out


def field_types(cls=Config, prefix: str = "") -> dict[str, type]:
    """Every leaf field as `dotted.name -> type` (nested dataclasses flattened)."""
    out: dict[str, type] = {}
    for name, f in _fields(cls).items():
        if dataclasses.is_dataclass(f.type):
            out.update(field_types(f.type, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = f.type
    return out


def suggest(key: str, valid: list[str]) -> str:
    """'; did you mean a, b?' for the closest valid names (by whole key and by last component)."""
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    if not close:
        tail = key.rsplit(".", 1)[-1]
        close = [v for v in valid if v.rsplit(".", 1)[-1] == tail][:3]
    return f"; did you mean {', '.join(close)}?" if close else ""


def to_config_dict(cfg: Config | None = None) -> ml_collections.ConfigDict:
    """The ConfigDict form of `cfg` (default: all defaults); config files start from this."""
    cfg = cfg if cfg is not None else Config()

    def convert(obj):
        if dataclasses.is_dataclass(obj):
            return {f.name: convert(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return obj

    return ml_collections.ConfigDict(convert(cfg))


default_config_dict = to_config_dict


def _coerce(name: str, typ: type, value: Any) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    elif typ is tuple:
        if isinstance(value, (tuple, list)):
            return _tuples(value)
    raise ConfigError(name, f"expected {typ.__name__}, got {type(value).__name__} {value!r}")


def _tuples(value: Any) -> Any:
    """Lists at any depth as tuples: a config saved as JSON (`to_dict`) reads back equal to the one
    written in Python (nested pairs such as `reward.options`)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (tuple, list)) else value


def _build(cls, data: Any, prefix: str):
    if isinstance(data, ml_collections.ConfigDict):
        data = data.to_dict()
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", f"expected a section, got {data!r}")
    fields = _fields(cls)
    valid = sorted(field_types(Config))
    for key in data:
        if key not in fields:
            full = f"{prefix}{key}"
            raise ConfigError(full, REMOVED_FIELDS.get(full) or f"unknown config key{suggest(full, valid)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        full = f"{prefix}{name}"
        if dataclasses.is_dataclass(f.type):
            kwargs[name] = _build(f.type, data[name], full + ".")
            continue
        value = _coerce(full, f.type, data[name])
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(full, f"{value!r} is not one of {', '.join(map(repr, choices))}")
        kwargs[name] = value
    return cls(**kwargs)


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> Config:
    """Typed `Config` from a ConfigDict; raises ConfigError on unknown keys, wrong types, bad choices."""
    return _build(Config, cd, "")


def parse_override(key: str, text: str) -> Any:
    """Parses a command-line override `--config.<key>=<text>` to the field's type; ConfigError if bad."""
    types_ = field_types(Config)
    if key not in types_:
        raise ConfigError(key, REMOVED_FIELDS.get(key) or f"unknown config key{suggest(key, sorted(types_))}")
    typ = types_[key]
    if typ is str:
        return text
    if typ is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(key, f"expected bool (true/false), got {text!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(key, f"expected {typ.__name__}, got {text!r}") from None
    if typ is tuple and not isinstance(value, (tuple, list)):
        value = (value,)
    return _coerce(key, typ, value)


def to_dict(cfg: Config) -> dict:
    """A plain, JSON-serializable dict of the resolved config (saved with every checkpoint)."""
    return to_config_dict(cfg).to_dict()
