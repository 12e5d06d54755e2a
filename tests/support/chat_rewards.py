"""A reward for tests/metrics/test_profile.py's run, loaded as "chat_rewards:<fn>" (tests/ on PYTHONPATH)."""

SYSTEM_PROMPT = "You add numbers."


def rendered_as_chat(*, prompt: str, completion: str, example: dict, **options) -> float:
    """1.0 when the prompt the loop sampled from is the example's conversation rendered by assets/tiny_arith's
    ChatML template (written out by hand here) with SYSTEM_PROMPT first and the generation prompt last."""
    turns = [{"role": "system", "content": SYSTEM_PROMPT}, *example["prompt"]]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns)
    return float(prompt == expected + "<|im_start|>assistant\n")
