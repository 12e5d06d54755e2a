"""Tiny Hugging Face checkpoints built locally (no hub access): random weights + a trained BPE tokenizer.

Used by tests, notebooks and the benchmark scripts. The directories look exactly like real local
checkpoints (config.json, model.safetensors, tokenizer.json, tokenizer_config.json), so every loader path
that serves Qwen2.5 or Llama 3 serves these too. Building one needs torch (transformers' reference models).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FAMILIES = ("qwen2", "qwen3", "llama")

# Printable ASCII so every digit, operator and letter has a byte-level token; chat markers are added tokens.
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    lines = []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            lines.append(f"What is {a} + {b}? Answer: {a + b}. #### {a + b}")
            lines.append(f"Compute {a} * {b} - {b} = {a * b - b}. \\boxed{{{a * b - b}}}")
    lines.append("The quick brown fox jumps over the lazy dog. user assistant system tool <think></think>")
    lines.append('{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}')
    return lines


def build_tokenizer(path: str | os.PathLike, vocab_size: int = 512):
    """Trains a byte-level BPE tokenizer of `vocab_size` entries and saves it (HF fast-tokenizer files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=_CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    return fast


def tiny_hf_config(
    family: str = "qwen2",
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    eos_token_id: int = 2,
):
    """A transformers config for a tiny model of `family` (head_dim = hidden/heads, >= 32 for vLLM CPU)."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=0,
        dtype="float32",
    )
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=hidden_size // num_heads, rope_theta=10000.0)
    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**common, rope_parameters=rope, attention_bias=False, mlp_bias=False)
    raise ValueError(f"unknown tiny model family {family!r}; valid: {', '.join(FAMILIES)}")


def build_tiny_checkpoint(
    path: str | os.PathLike,
    family: str = "qwen2",
    *,
    seed: int = 0,
    init_std: float = 0.1,
    **config_overrides,
) -> Path:
    """Writes a random tiny `family` checkpoint plus tokenizer to `path` and returns the path.

    `init_std` is larger than transformers' default so log-probs are far from uniform: a wrong weight
    mapping then shows up as a large log-prob difference, not as noise.
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, vocab_size=config_overrides.get("vocab_size", 512))
    config_overrides.setdefault("eos_token_id", tokenizer.convert_tokens_to_ids("<|im_end|>"))
    config = tiny_hf_config(family, **config_overrides)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases off their trivial init, so every tensor matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    gen = {"eos_token_id": config.eos_token_id, "pad_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
