"""Prompts for the loop: example sources (files, `datasets` dirs, procedural tasks), a train/eval split
that never leaks held-out prompts, a restorable batch iterator, and prompt rendering (plain-text templates,
or conversations through the tokenizer's chat template).

An example is a dict with at least "prompt" (a str, or a list of {"role", "content"} messages) and
"answer" (str), plus any other fields.
"""

from rljax.data import procedural, word_problems  # noqa: F401  (arithmetic, countdown, word_problems)
from rljax.data.chat import ChatRenderer, PlainRenderer, is_conversation, make_prompt_renderer
from rljax.data.iterator import PromptIterator, epoch_permutation, format_prompt, split_train_eval
from rljax.data.sources import SOURCES, Example, make_source, map_fields

__all__ = [
    "SOURCES",
    "ChatRenderer",
    "Example",
    "PlainRenderer",
    "PromptIterator",
    "epoch_permutation",
    "format_prompt",
    "is_conversation",
    "make_prompt_renderer",
    "make_source",
    "map_fields",
    "split_train_eval",
]
