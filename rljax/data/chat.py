"""Prompt rendering: plain-text templates, or conversations through the tokenizer's own chat template.

A prompt is either a str or a conversation: a list of {"role": str, "content": str} messages (TRL's
convention for conversational prompt data sets). `make_prompt_renderer` chooses the renderer once, from
config: `PlainRenderer` fills `data.template`; `ChatRenderer` renders the messages with
`tokenizer.apply_chat_template(..., add_generation_prompt=True)`, exactly as vLLM's chat endpoint does
(`vllm.renderers.hf.safe_apply_chat_template`), so the token ids the trainer sends are the ones
`/v1/chat/completions` would build for the same messages (tests/data/test_chat_template.py checks this
against a real vLLM server).
"""

from __future__ import annotations

import dataclasses
from typing import Any

Message = dict[str, str]


def is_conversation(prompt: Any) -> bool:
    """True for a list of {"role", "content"} dicts with str values (a chat prompt)."""
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    )


def check_prompt(prompt: Any, where: str) -> str | list[Message]:
    """The prompt as a str, or a conversation as a list of plain message dicts; a list that is not a
    well-formed conversation is an error naming `where`."""
    if isinstance(prompt, (list, tuple)):
        if not is_conversation(prompt):
            raise ValueError(
                f"{where}: a list prompt must be a non-empty conversation of "
                f'{{"role": str, "content": str}} messages, got {prompt!r:.200}'
            )
        return [dict(m) for m in prompt]
    return str(prompt)


@dataclasses.dataclass(frozen=True)
class PlainRenderer:
    """Fills `template` (str.format) from the example's fields; token ids without special tokens."""

    tokenizer: Any
    template: str

    def text(self, example: dict) -> str:
        if is_conversation(example["prompt"]):
            raise ValueError(
                "data.chat_template: this example's prompt is a conversation (a list of messages); "
                "set data.chat_template=true to render it with the tokenizer's chat template"
            )
        return self.template.format(**example)

    def ids(self, example: dict) -> list[int]:
        return list(self.tokenizer(self.text(example), add_special_tokens=False)["input_ids"])


@dataclasses.dataclass(frozen=True)
class ChatRenderer:
    """Renders `messages(example)` with the tokenizer's chat template and a generation prompt."""

    tokenizer: Any
    template: str
    system_prompt: str = ""

    def messages(self, example: dict) -> list[Message]:
        """The example's conversation; a str prompt (after `template`) becomes one user message. The
        system prompt goes first unless the conversation already has a system message."""
        prompt = example["prompt"]
        if is_conversation(prompt):
            messages = [dict(m) for m in prompt]
        else:
            messages = [{"role": "user", "content": self.template.format(**example)}]
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def text(self, example: dict) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages(example), tokenize=False, add_generation_prompt=True
        )

    def ids(self, example: dict) -> list[int]:
        # tokenize=True in apply_chat_template, return_dict=False: the call vLLM makes (transformers 5
        # returns a BatchEncoding unless told otherwise); it encodes without adding special tokens.
        ids = self.tokenizer.apply_chat_template(
            self.messages(example), tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return [int(i) for i in ids]


def make_prompt_renderer(
    tokenizer: Any, *, template: str, chat_template: bool, system_prompt: str = ""
) -> PlainRenderer | ChatRenderer:
    """The renderer for `data.*`: `.text(example) -> str` and `.ids(example) -> list[int]`."""
    if not chat_template:
        return PlainRenderer(tokenizer, template)
    if not tokenizer.chat_template:
        raise ValueError("data.chat_template: the tokenizer has no chat template")
    return ChatRenderer(tokenizer, template, system_prompt)
