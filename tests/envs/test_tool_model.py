"""The committed tool-calling model (tests/assets/tiny_calculator) is what its builder makes: the same
architecture, tokenizer and tensor names and shapes (a short build; the full one teaches ~100 CPU-s)."""

import json

import tool_model
from safetensors import safe_open


def _tensors(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), "np") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def test_builder_makes_the_committed_models_architecture_and_tokenizer(tmp_path):
    built = tmp_path / "model"
    tool_model.build_tool_model(built, steps=2)
    asset = tool_model.ASSET
    config = json.loads((built / "config.json").read_text())
    committed = json.loads((asset / "config.json").read_text())
    for c in (config, committed):
        c.pop("transformers_version", None)
    assert config == committed
    assert (built / "tokenizer.json").read_text() == (asset / "tokenizer.json").read_text()
    assert _tensors(built) == _tensors(asset)
