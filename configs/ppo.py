"""PPO with a learned critic and GAE on the arithmetic task.

Command (2-core CPU, real vLLM CPU build):
    .venv/bin/python -m rljax.main --config=configs/ppo.py --workdir=/tmp/rljax_ppo
A good run: eval/accuracy rises, `loss/value` falls over the first steps, clip fractions stay < 0.2.
References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GAE: Schulman et al. 2016.
"""

from configs import grpo


def get_config(preset=None):
    cfg = grpo.get_config(preset)
    cfg.algo.family = "ppo"
    cfg.algo.gamma = 1.0
    cfg.algo.lam = 0.95
    cfg.rollout.group_size = 1
    cfg.algo.aggregation = "token_mean"
    cfg.trainer.tokens_per_micro_batch = 0  # packing is for the GRPO family (PPO's value targets are per row)
    return cfg
