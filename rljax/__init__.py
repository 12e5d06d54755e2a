"""rljax: RL post-training for LLMs on JAX (GRPO/PPO family, vLLM rollouts, verified weight sync)."""

__version__ = "0.1.0"
