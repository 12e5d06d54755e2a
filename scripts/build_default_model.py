"""Builds `assets/tiny_arith`: the small warm-started model the default job (configs/grpo.py) trains.

No model can be downloaded, so the default job ships its own: a tiny Qwen2 (vocab 512, hidden 128, 2 layers)
trained here by supervised learning on the built-in arithmetic task ("7 + 18 =" -> " 25") with a
*systematically noisy teacher*: the target is the correct answer with probability `p_correct` and the answer
plus one otherwise. The model learns the arithmetic and the global off-by-one habit, so at the sampling
temperature it is right about `p_correct` of the time: above chance, far from perfect. RL only sees rewards
and must learn to drop the habit; since the habit is shared by all prompts, what it learns on the training
prompts shows on the held-out ones (`eval/accuracy`). The teacher covers every prompt of the task (as
pre-training would); RL never trains on the held-out prompts.

    .venv/bin/python scripts/build_default_model.py --out assets/tiny_arith   # ~15 CPU-minutes

Measured for the committed model (2500 steps, p_correct 0.3; exact sequence probabilities over all 400
prompts): P(correct) 0.30, P(answer + 1) 0.63, anything else 0.08. Addition keeps the arithmetic within
reach of a 2-layer model, so what limits accuracy is the habit, which RL can remove: with "+" and "*" up
to 12 the model also got 20% of products wrong outright and GRPO lifted eval/accuracy by only ~0.13.
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import torch
import transformers

from rljax.config import Config
from rljax.data import make_source
from rljax.models.tiny import build_tokenizer, tiny_hf_config

# The default job's task, read from the config defaults so that the model and the job never disagree.
TASK = dict(Config().data.source_options) | {"seed": Config().data.seed}


def teacher_target(answer: str, rng: random.Random, p_correct: float) -> str:
    return f" {answer}" if rng.random() < p_correct else f" {int(answer) + 1}"


def encode(tok, prompt: str, target: str) -> tuple[list[int], int]:
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    t = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p + t, len(p)


def make_batch(tok, examples, rng, p_correct, batch_size):
    rows = [
        encode(tok, ex["prompt"], teacher_target(ex["answer"], rng, p_correct))
        for ex in rng.sample(examples, batch_size)
    ]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(batch_size, width, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    attn = torch.zeros(batch_size, width, dtype=torch.long)
    for i, (row, plen) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, plen : len(row)] = torch.tensor(row[plen:])
        attn[i, : len(row)] = 1
    return ids, labels, attn


@torch.no_grad()
def sampled_accuracy(model, tok, examples, n=200, seed=1) -> tuple[float, float]:
    """(accuracy at temperature 1, fraction answering answer+1) over `n` examples."""
    rng = random.Random(seed)
    right = plus_one = 0
    for ex in rng.sample(examples, min(n, len(examples))):
        ids = torch.tensor([tok(ex["prompt"], add_special_tokens=False)["input_ids"]])
        out = model.generate(
            ids,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=6,
            eos_token_id=tok.eos_token_id,
            pad_token_id=0,
        )
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        right += text == ex["answer"]
        plus_one += text == str(int(ex["answer"]) + 1)
    return right / n, plus_one / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="assets/tiny_arith")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--p-correct", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    eos = build_tokenizer(out).eos_token_id
    config = tiny_hf_config("qwen2", eos_token_id=eos)
    config.save_pretrained(str(out))
    # Train with the tokenizer exactly as transformers and vLLM load it from the finished directory: with a
    # qwen2 config.json next to it, AutoTokenizer applies Qwen2's pre-tokenizer (digits split one by one),
    # which differs from the in-memory tokenizer `build_tokenizer` returns.
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    examples = list({ex["prompt"]: ex for ex in make_source("arithmetic", **TASK)}.values())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.05)
    for step in range(args.steps):
        ids, labels, attn = make_batch(tok, examples, rng, args.p_correct, 64)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 500 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    model.eval()
    acc, plus_one = sampled_accuracy(model, tok, examples)
    print(f"{len(examples)} distinct prompts; sampled accuracy {acc:.2f}, answer+1 {plus_one:.2f}")
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(f'{{"eos_token_id": {tok.eos_token_id}, "pad_token_id": 0}}')


if __name__ == "__main__":
    main()
