"""Prompts for the loop: example sources (files, `datasets` dirs, procedural tasks), a train/eval split
that never leaks held-out prompts, a restorable batch iterator, and plain-text prompt templates.

An example is a dict with at least "prompt" (str) and "answer" (str), plus any other fields.
"""

from rljax.data import procedural  # noqa: F401  (registers arithmetic, countdown)
from rljax.data.iterator import PromptIterator, epoch_permutation, format_prompt, split_train_eval
from rljax.data.sources import SOURCES, Example, make_source, map_fields

__all__ = [
    "SOURCES",
    "Example",
    "PromptIterator",
    "epoch_permutation",
    "format_prompt",
    "make_source",
    "map_fields",
    "split_train_eval",
]
