"""Dr. GRPO: no std scaling of advantages and a fixed-length loss normalizer.

Command (2-core CPU, real vLLM CPU build):
    .venv/bin/python -m rljax.main --config=configs/drgrpo.py --workdir=/tmp/rljax_drgrpo
A good run looks like the GRPO default (eval/accuracy up >= 0.25) without the length bias of
per-sequence normalization (`response/length_mean` does not drift up on wrong answers).
References: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective".
"""

from configs import grpo


def get_config(preset=None):
    cfg = grpo.get_config(preset)
    cfg.algo.advantage = "drgrpo"
    cfg.algo.aggregation = "seq_mean_token_sum_norm"
    return cfg
