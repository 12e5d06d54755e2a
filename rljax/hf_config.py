"""`read_hf_config(path)`: the parsed `config.json` of a Hugging Face checkpoint directory, rljax's one
reader of it (the loader, the checks, the hand memory formula, export and the engine's vocabulary all call
this; `rljax.models.read_model_config` turns it into a `ModelConfig`). A leaf module, the stdlib only, so
the start-up checks read a model's sizes before JAX is imported."""

from __future__ import annotations

import json
from pathlib import Path


def read_hf_config(path: str | Path) -> dict:
    """`<path>/config.json`, parsed. OSError when it cannot be read, ValueError when it is not JSON."""
    return json.loads((Path(path) / "config.json").read_text())
