"""DAPO: GRPO plus clip-higher, dynamic sampling, token-mean loss and soft overlong shaping.

Command (2-core CPU, real vLLM CPU build):
    .venv/bin/python -m rljax.main --config=configs/dapo.py --workdir=/tmp/rljax_dapo
A good run looks like the GRPO default (eval/accuracy up >= 0.25), with `reward/frac_zero_std_groups`
reported and refilled, and `clip/frac_high` below `clip/frac_low` early on.
References: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale".
"""

from configs import grpo


def get_config(preset=None):
    cfg = grpo.get_config(preset)
    cfg.algo.clip_low = 0.2
    cfg.algo.clip_high = 0.28
    cfg.algo.dynamic_sampling = True
    cfg.algo.aggregation = "token_mean"
    cfg.algo.beta = 0.0
    cfg.algo.overlong_buffer = 4
    return cfg
