"""The tiny tool-calling model of the multi-turn tests: `tests/assets/tiny_calculator`, and how it is built.

A random tiny model never writes a tool call, so the multi-turn tests serve one taught the calculator_math
format by supervised learning (transformers, labels on the model's turns only): close the prefilled
calculator call, then answer after the tool response. Teaching it costs ~100 CPU-seconds (200 AdamW steps
of 16 rows), so the result is committed and the tests load it; rebuild it after a change to the
environment's format or to `tiny_hf_config`:

    .venv/bin/python tests/support/tool_model.py --out tests/assets/tiny_calculator
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

from rljax.envs.math_env import TOOL_RESPONSE, ToolMathEnv
from rljax.envs.tools import calculator_tool

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny_calculator"
SFT_STEPS = 200
TASK = {"num_examples": 400, "seed": 0, "max_value": 4, "ops": ("+",)}  # the tests' prompts


def _sft_rows(tok, ex) -> tuple[list[int], list[int]]:
    env = ToolMathEnv()
    segments = [
        (env.reset(ex), False),
        ('"}}</tool_call>', True),
        (TOOL_RESPONSE.format(output=calculator_tool({"expression": ex["expr"]})), False),
        (f" {ex['answer']}<|im_end|>", True),
    ]
    ids, labels = [], []
    for text, train in segments:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        labels += t if train else [-100] * len(t)
    return ids, labels


def build_tool_model(out: str | Path, steps: int = SFT_STEPS) -> str:
    """A tiny Qwen2 taught the calculator_math format (seeded: the same weights on the same torch build)."""
    import torch
    import transformers

    from rljax.data import make_source
    from rljax.models.tiny import build_tokenizer, tiny_hf_config

    out = str(out)
    torch.manual_seed(0)
    rng = random.Random(0)
    config = tiny_hf_config("qwen2", eos_token_id=build_tokenizer(out).eos_token_id)
    config.save_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)  # as vLLM and the loop load it
    data = [_sft_rows(tok, ex) for ex in make_source("arithmetic", **TASK)]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    for _ in range(steps):
        batch = rng.sample(data, 16)
        width = max(len(i) for i, _ in batch)
        ids = torch.zeros(16, width, dtype=torch.long)
        labels = torch.full((16, width), -100, dtype=torch.long)
        attn = torch.zeros(16, width, dtype=torch.long)
        for k, (i, lab) in enumerate(batch):
            ids[k, : len(i)], labels[k, : len(i)], attn[k, : len(i)] = torch.tensor(i), torch.tensor(lab), 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ASSET))
    parser.add_argument("--steps", type=int, default=SFT_STEPS)
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    print(build_tool_model(args.out, args.steps))


if __name__ == "__main__":
    main()
