# %% [markdown]
# # 01 · GRPO quickstart: a tiny model learns arithmetic, with real vLLM rollouts
#
# The default job (`configs/grpo.py`: the committed 2-layer model `assets/tiny_arith`, the procedural
# arithmetic task, GRPO with group size 8), shortened to a dozen steps. The notebook starts **one** vLLM
# server itself (`rljax.rollout.RolloutEngine.launch`) and points the training loop at it with
# `cfg.rollout.vllm.urls`, so the same server is used for the samples before and after training.
# Everything else is the library's own path: `rljax.loop.train.train(cfg, workdir)` runs
# rollout -> rewards -> update -> verified weight sync -> eval, and writes `workdir/metrics.jsonl`.
#
# On a 2-core CPU this takes about two minutes (vLLM start-up is ~25 s of it); on a GPU runtime, much less.

# %% [install]

# %%
import atexit
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import matplotlib

if "ipykernel" not in sys.modules:  # run as a script: no frontend to draw into
    matplotlib.use("Agg")
import jax
import matplotlib.pyplot as plt
import numpy as np

import rljax
from rljax import config as config_lib
from rljax import models
from rljax.loop.data_setup import load_examples
from rljax.loop.train import train
from rljax.rewards import RewardPool
from rljax.rollout import RolloutEngine, ServerOptions


def find_root() -> pathlib.Path:
    """The rljax checkout (it holds assets/ and configs/): here, above here, the package's, or the clone."""
    here = pathlib.Path.cwd()
    candidates = [here, here.parent, pathlib.Path(rljax.__file__).resolve().parents[1]]
    candidates.append(pathlib.Path(os.environ.get("RLJAX_DIR", "/content/rljax")))
    for root in candidates:
        if (root / "assets" / "tiny_arith" / "config.json").is_file():
            return root
    raise FileNotFoundError(f"no rljax checkout with assets/tiny_arith among {candidates}")


ROOT = find_root()
WORKDIR = pathlib.Path(os.environ.get("RLJAX_NOTEBOOK_WORKDIR") or tempfile.mkdtemp(prefix="rljax_01_"))
print("jax", jax.__version__, jax.default_backend(), "| checkout:", ROOT, "| workdir:", WORKDIR)

# %% [markdown]
# ## 1. The config: the default job, shortened
#
# `configs/grpo.py` with no preset is the default job. We keep its model, task, algorithm and optimizer and
# change only the run length and the I/O: 12 steps of 64 completions (8 prompts x 8 samples),
# `eval/accuracy` on 64 held-out prompts at steps 0, 6 and 12, no TensorBoard, one checkpoint at the end.

# %%
spec = importlib.util.spec_from_file_location("grpo_config", ROOT / "configs" / "grpo.py")
grpo_config = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpo_config)

cd = grpo_config.get_config()  # an ml_collections.ConfigDict, as `--config=configs/grpo.py` gives
STEPS = 12
cd.model.path = str(ROOT / "assets" / "tiny_arith")
cd.trainer.steps = STEPS
cd.trainer.eval_every = 6
cd.checkpoint.every_steps = STEPS
cd.metrics.tensorboard = False
cd.metrics.console = False  # the metrics are plotted below instead
print(
    f"model {cd.model.path} | {cd.rollout.batch_size} completions/step (group {cd.rollout.group_size}) | "
    f"lr {cd.optim.learning_rate} | max_tokens {cd.rollout.max_tokens} | eval on {cd.data.eval_size} prompts"
)

# %% [markdown]
# ## 2. One vLLM server (the real CPU build), small on purpose
#
# `gpu_memory_utilization` is the fraction of host RAM vLLM reserves on the CPU build; `kvcache_space_gib`
# caps the KV cache. The server dies with this kernel (and `atexit` stops it on a clean exit), so a failing
# cell never leaves it running; the last cell stops it explicitly. (The `os.fork()` RuntimeWarning comes
# from `subprocess` starting vLLM from a process that runs JAX threads; the child only sets its death signal
# and then execs vLLM.)

# %%
t0 = time.perf_counter()
engine = RolloutEngine.launch(
    cd.model.path,
    WORKDIR / "vllm",
    server_options=ServerOptions(
        gpu_memory_utilization=0.08, kvcache_space_gib=1, max_model_len=512, seed=cd.trainer.seed
    ),
)
atexit.register(engine.close)
cd.rollout.vllm.urls = tuple(engine.urls)  # the loop connects to this server instead of starting one
cd.rollout.vllm.token_file = str(engine.servers[0].token_file)  # ... with the bearer token it was started with
cfg = config_lib.validate(config_lib.from_config_dict(cd))  # the typed, checked config rljax.main uses
print(f"vLLM up at {engine.urls[0]} in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ## 3. Before training: greedy answers on held-out prompts
#
# The eval split of the same procedural data set the loop trains on (no eval prompt appears in training).
# The `math` verifier scores a completion 1 when its final number equals the answer.

# %%
tokenizer = models.load_tokenizer(cfg.model.path)
_, eval_examples = load_examples(cfg.data)
eval_ids = [
    tokenizer(cfg.data.template.format(**ex), add_special_tokens=False)["input_ids"] for ex in eval_examples
]
verifier = RewardPool([("math", 1.0, {})], num_workers=1, timeout_s=5.0)
atexit.register(verifier.close)


def greedy_answers() -> tuple[list[str], np.ndarray]:
    """Greedy completions of every eval prompt from the served weights, and their verifier scores."""
    out = engine.generate(
        eval_ids,
        n=1,
        temperature=0.0,
        max_tokens=cfg.rollout.max_tokens,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    texts = [
        tokenizer.decode(c.token_ids, skip_special_tokens=True)
        for c in sorted(out, key=lambda c: c.prompt_index)
    ]
    items = [
        {"prompt": ex["prompt"], "completion": t, "example": ex}
        for ex, t in zip(eval_examples, texts, strict=True)
    ]
    scores, _, _ = verifier.score(items)
    return texts, np.asarray(scores)


def show(texts, scores, k=6):
    for ex, t, s in list(zip(eval_examples, texts, scores, strict=True))[:k]:
        print(f"{'ok ' if s >= 0.5 else '   '} {ex['prompt']!r:>14} -> {t!r:<24} (answer {ex['answer']})")


before_texts, before_scores = greedy_answers()
print(f"greedy accuracy before: {before_scores.mean():.2f} on {len(eval_examples)} prompts")
show(before_texts, before_scores)

# %% [markdown]
# ## 4. Train: `rljax.loop.train.train(cfg, workdir)`
#
# Each step: 8 prompts x 8 samples from vLLM (temperature 1), math rewards, group-relative advantages,
# one clipped-PPO update in JAX, then the new weights are pushed into the running server through shared
# memory and checked by the canary (a few tokens scored by both sides) before the next rollout.

# %%
run_dir = WORKDIR / "run"
t0 = time.perf_counter()
train(cfg, str(run_dir))
train_s = time.perf_counter() - t0
lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
print(f"{STEPS} steps in {train_s:.1f} s ({train_s / STEPS:.1f} s/step); {len(lines)} metrics lines")
assert [m["step"] for m in lines] == list(range(STEPS + 1)), "one metrics line per step (0 = before training)"

# %% [markdown]
# ## 5. The curves
#
# `reward/mean` is the mean reward of each step's 64 samples (noisy: ~0.06 std at this size);
# `eval/accuracy` is the expected pass@1 at temperature 1 on the 64 held-out prompts. The right panel is the
# health check of the whole pipeline: the largest per-token difference between the trainer's log-prob and
# the one vLLM reported for the same sampled token, on the same weights (float32: ~1e-6..1e-5).

# %%
train_lines = [m for m in lines if m["step"] > 0]
steps = [m["step"] for m in train_lines]
reward = np.array([m["reward/mean"] for m in train_lines])
evals = [(m["step"], m["eval/accuracy"]) for m in lines if "eval/accuracy" in m]
diff = np.array([m["logprob/trainer_vs_rollout_abs_diff_max"] for m in train_lines])

fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
axes[0].plot(steps, reward, "o-", label="reward/mean (train samples)")
axes[0].plot(*zip(*evals, strict=True), "s--", label="eval/accuracy (held out)")
axes[0].set_xlabel("step")
axes[0].set_ylim(0, 1)
axes[0].legend()
axes[0].set_title("GRPO on arithmetic")
axes[1].plot(steps, [m["entropy/mean"] for m in train_lines], "o-", label="entropy/mean (nats/token)")
axes[1].plot(steps, [m["response/length_mean"] for m in train_lines], "s--", label="response/length_mean")
axes[1].set_xlabel("step")
axes[1].set_title("the policy sharpens")
axes[1].legend()
axes[2].semilogy(steps, diff, "o-")
axes[2].axhline(1e-4, color="red", ls=":", label="1e-4")
axes[2].set_xlabel("step")
axes[2].set_title("max |trainer - vLLM| log-prob")
axes[2].legend()
plt.tight_layout()
plt.show()
print("eval/accuracy:", {s: round(a, 3) for s, a in evals})
print(f"reward/mean: steps 1-3 {reward[:3].mean():.3f} -> last 3 {reward[-3:].mean():.3f}")
assert np.all(diff < 1e-4), diff  # same weights on both sides: anything larger is a broken pipeline

# %% [markdown]
# ## 6. After training: the same prompts, greedy, from the server (it now serves the trained weights)

# %%
after_texts, after_scores = greedy_answers()
print(f"greedy accuracy: before {before_scores.mean():.2f} -> after {after_scores.mean():.2f}")
changed = [i for i, (a, b) in enumerate(zip(before_texts, after_texts, strict=True)) if a != b]
print(f"{len(changed)} of {len(eval_examples)} greedy answers changed; a few of them (before -> after):")
for i in changed[:6]:
    ex = eval_examples[i]
    print(f"  {ex['prompt']!r:>14} {before_texts[i]!r:<22} -> {after_texts[i]!r:<22} (answer {ex['answer']})")

# %% [markdown]
# ## 7. Stop the server
#
# The trained weights are in `run/checkpoints/`; `python -m rljax.main ... --workdir=<that run>` resumes it.

# %%
verifier.close()
engine.close()
print("vLLM server stopped:", not engine.servers[0].alive())
