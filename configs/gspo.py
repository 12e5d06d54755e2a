"""GSPO: sequence-level, length-normalized importance ratio with sequence-level clipping.

Command (2-core CPU, real vLLM CPU build):
    .venv/bin/python -m rljax.main --config=configs/gspo.py --workdir=/tmp/rljax_gspo
A good run looks like the GRPO default (eval/accuracy up >= 0.25); clip fractions are per sequence.
References: Zheng et al. 2025, "Group Sequence Policy Optimization".
"""

from configs import grpo


def get_config(preset=None):
    cfg = grpo.get_config(preset)
    cfg.algo.policy_loss = "gspo"
    cfg.algo.clip_low = 3e-4
    cfg.algo.clip_high = 4e-4
    cfg.algo.aggregation = "seq_mean_token_mean"
    cfg.algo.is_level = "sequence"
    return cfg
