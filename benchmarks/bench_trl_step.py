"""A GRPO step of rljax against TRL's on the same pretrained model, prompts, reward and hyperparameters.

Command (2-core CPU, ~25 min with the defaults; TRL is a benchmark dependency only, installed beside):
    .venv/bin/pip install --no-deps --target .bench-pkgs trl==1.16.0
    PYTHONPATH=.bench-pkgs .venv/bin/python benchmarks/bench_trl_step.py [--steps 20] [--skip 3]
        [--json out.json] [--only rljax|trl] [--rljax-arg --config.field=value]...

Both stacks run SmolLM2-135M-Instruct (the converted directory `rljax.models.fetch` writes) on the
`configs/smollm2_math.py` task: its word problems, rendered with the model's chat template and the
preset's system prompt, graded by rljax's `math` reward (Math-Verify). Settings, the same in both:
`--prompts` 4 prompts x `--group` 8 completions per step, `--max-tokens` 32 completion tokens, temperature
0.7, learning rate 2e-5, AdamW with global-norm clipping 1.0, beta 0 (no reference model), one update per
step (TRL's `num_iterations=1`; rljax's on-policy update), float32.

- rljax: `python -m rljax.main --config=configs/smollm2_math.py` with those settings, no evaluation and no
  checkpoints (a subprocess, as a user runs it); its split is the loop's own `timing/*` metrics:
  generation (vLLM CPU engine), update, weight sync.
- TRL: `trl.GRPOTrainer` (transformers generation, torch update, `use_cpu`), in a subprocess with the same
  2 threads; its split: generation + scoring (`_generate_and_score_completions`, timed around TRL's own
  call) and the rest of the step (the torch update).

The two run one after the other (a step takes tens of seconds, so interleaving steps is not possible
without running both at once); medians over the steps after `--skip` (compiles and warm-up). Prints each
phase's median seconds and the ratio rljax / TRL of the whole step (target: <= 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PRESET = ROOT / "configs" / "smollm2_math.py"


def settings(args) -> dict:
    return dict(prompts=args.prompts, group=args.group, max_tokens=args.max_tokens, lr=args.lr,
                steps=args.steps, temperature=0.7, seed=args.seed)  # fmt: skip


# ------------------------------------------------------------------------------------------------ rljax
def rljax_command(args, workdir: Path) -> list[str]:
    s = settings(args)
    overrides = {
        "rollout.batch_size": s["prompts"] * s["group"],
        "rollout.group_size": s["group"],
        "rollout.max_tokens": s["max_tokens"],
        "rollout.temperature": s["temperature"],
        "optim.learning_rate": s["lr"],
        "trainer.steps": s["steps"],
        "trainer.seed": s["seed"],
        "trainer.eval_every": 0,
        "checkpoint.every_steps": s["steps"],  # one, at the last step (the median ignores it)
        # the preset's length penalty is part of its task, not of this comparison: `math` alone, as TRL's
        "reward.functions": "('math',)",
        "reward.weights": "(1.0,)",
        "reward.options": "()",
    }
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    return [sys.executable, "-m", "rljax.main", f"--config={PRESET}", f"--workdir={workdir}", *flags,
            *args.rljax_arg]  # fmt: skip


def run_rljax(args, workdir: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(workdir.parent / "rljax.log", "w") as log:
        proc = subprocess.run(rljax_command(args, workdir), cwd=ROOT, env=env, stdout=log, stderr=log)
    if proc.returncode != 0:
        sys.exit(f"rljax run failed (exit {proc.returncode}); log: {workdir.parent / 'rljax.log'}")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [
        {
            "step": r["timing/step_s"],
            "generation": r["timing/rollout_s"],
            "update": r["timing/update_s"],
            "sync": r["timing/weight_sync_s"],
            "reward": r.get("reward/mean", 0.0),
        }
        for r in rows
        if "timing/step_s" in r
    ]


# ------------------------------------------------------------------------------------------------ TRL
def trl_prompts(cfg, model_path: str) -> list[dict]:
    """The preset's training examples as TRL conversational prompts (the system prompt and the problem),
    in rljax's seeded order, each with its reference answer."""
    import transformers

    from rljax.data import make_prompt_renderer
    from rljax.loop.data_setup import load_examples

    train, _ = load_examples(cfg.data)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    renderer = make_prompt_renderer(
        tokenizer, template=cfg.data.template, chat_template=True, system_prompt=cfg.data.system_prompt
    )
    return [{"prompt": renderer.messages(ex), "answer": str(ex["answer"])} for ex in train]


def trl_worker(args, out: Path) -> None:
    """Runs TRL's GRPOTrainer (in its own process) and writes one timing row per step to `out`."""
    import datasets
    import torch
    import transformers
    import trl

    from rljax.models.fetch import resolve_model_path
    from rljax.rewards.math_verify import math_reward
    from rljax.runtime import config_from_args

    torch.set_num_threads(os.cpu_count() or 1)
    s = settings(args)
    cfg = config_from_args([f"--config={PRESET}"])
    model_path = resolve_model_path(cfg.model.path)
    data = datasets.Dataset.from_list(trl_prompts(cfg, model_path))

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        pairs = zip(texts, answer, strict=True)
        return [math_reward(prompt="", completion=t, example={"answer": a}) for t, a in pairs]

    generation: list[float] = []

    class TimedGRPO(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            generation.append(time.perf_counter() - t0)
            return result

    rows: list[dict] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            total = time.perf_counter() - self.t0
            gen = generation[-1] if generation else 0.0
            rows.append({"step": total, "generation": gen, "update": total - gen, "sync": 0.0})

    config = trl.GRPOConfig(
        output_dir=str(out.parent / "trl"), max_steps=s["steps"], learning_rate=s["lr"],
        per_device_train_batch_size=s["prompts"] * s["group"], gradient_accumulation_steps=1,
        num_generations=s["group"], max_completion_length=s["max_tokens"], temperature=s["temperature"],
        beta=0.0, num_iterations=1, max_grad_norm=1.0, weight_decay=0.0, lr_scheduler_type="constant",
        warmup_steps=0, use_cpu=True, bf16=False, fp16=False, seed=s["seed"], logging_steps=1,
        save_strategy="no", report_to=[], dataloader_num_workers=0, disable_dropout=True,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path, padding_side="left")
    trainer = TimedGRPO(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
        callbacks=[StepTimer()],
    )  # fmt: skip
    trainer.train()
    out.write_text(json.dumps(rows))


def run_trl(args, workdir: Path) -> list[dict]:
    out = workdir / "trl_rows.json"
    cmd = [sys.executable, __file__, "--trl-worker", str(out), *worker_flags(args)]
    with open(workdir / "trl.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=log)
    if proc.returncode != 0:
        sys.exit(f"TRL run failed (exit {proc.returncode}); log: {workdir / 'trl.log'}")
    return json.loads(out.read_text())


def worker_flags(args) -> list[str]:
    return [f"--prompts={args.prompts}", f"--group={args.group}", f"--max-tokens={args.max_tokens}",
            f"--lr={args.lr}", f"--steps={args.steps}", f"--seed={args.seed}"]  # fmt: skip


# ------------------------------------------------------------------------------------------------ report
PHASES = ("step", "generation", "update", "sync")


def medians(rows: list[dict], skip: int) -> dict:
    kept = rows[skip:] or rows
    return {p: statistics.median(r[p] for r in kept) for p in PHASES}


def report(results: dict[str, dict]) -> dict:
    print(f"{'seconds (median)':<18s}" + "".join(f"{p:>12s}" for p in PHASES))
    for name, med in results.items():
        print(f"{name:<18s}" + "".join(f"{med[p]:12.2f}" for p in PHASES))
    out = {"medians": results}
    if {"rljax", "trl"} <= results.keys():
        ratio = results["rljax"]["step"] / results["trl"]["step"]
        out["step_ratio_rljax_over_trl"] = ratio
        print(f"step rljax / TRL: {ratio:.2f}x (target <= 1.0)")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=3, help="leading steps left out of the medians")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("rljax", "trl"), default="")
    p.add_argument("--rljax-arg", action="append", default=[], help="an extra rljax.main flag")
    p.add_argument("--json", default="")
    p.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.trl_worker:
        return trl_worker(args, Path(args.trl_worker))
    results, raw = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        tmp = Path(tmp)
        if args.only in ("", "rljax"):
            raw["rljax"] = run_rljax(args, tmp / "rljax")
            results["rljax"] = medians(raw["rljax"], args.skip)
        if args.only in ("", "trl"):
            raw["trl"] = run_trl(args, tmp)
            results["trl"] = medians(raw["trl"], args.skip)
    out = report(results) | {"per_step": raw, "settings": settings(args), "rljax_args": args.rljax_arg}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
