"""Flax decoder LLMs with exact Hugging Face interop (Qwen2/Qwen2.5, Qwen3, Llama 3)."""
