"""Prompt batching with an exactly restorable position, train/eval splitting, plain-text templates."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

Example = dict[str, Any]


def epoch_permutation(num_examples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Order of example indices in `epoch`: i64[num_examples], a function of (seed, epoch) only."""
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return rng.permutation(num_examples).astype(np.int64)


class PromptIterator(Iterator[list[Example]]):
    """Endless batches of `batch_size` examples; each epoch visits every example once in the order
    `epoch_permutation(n, seed, epoch)`. A batch that reaches the end of an epoch continues into the next,
    so every batch is full. `state()` is {epoch, index, seed, num_examples} (ints); `restore(state)` or
    `PromptIterator.from_state` resume exactly where it was.
    """

    def __init__(self, examples: Iterable[Example], *, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.examples: Sequence[Example] = examples if isinstance(examples, Sequence) else list(examples)
        if not self.examples:
            raise ValueError("PromptIterator needs at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.epoch, self.index = 0, 0
        self._order = epoch_permutation(len(self.examples), self.seed, 0, self.shuffle)

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[Example]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self.examples):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = epoch_permutation(len(self.examples), self.seed, self.epoch, self.shuffle)
            take = min(self.batch_size - len(batch), len(self.examples) - self.index)
            batch.extend(self.examples[int(i)] for i in self._order[self.index : self.index + take])
            self.index += take
        return batch

    def state(self) -> dict[str, int]:
        """The exact position: epoch, index (next position in this epoch's order), seed, num_examples."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_examples": len(self.examples),
        }

    def restore(self, state: dict[str, int]) -> None:
        """Moves to a position saved by `state()`; raises if it belongs to another seed or data set size."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state has seed {state['seed']}, this iterator has seed {self.seed}")
        if "num_examples" in state and int(state["num_examples"]) != len(self.examples):
            raise ValueError(
                f"state is for {state['num_examples']} examples, this iterator has {len(self.examples)}"
            )
        if not 0 <= int(state["index"]) <= len(self.examples) or int(state["epoch"]) < 0:
            raise ValueError(f"state out of range: {state}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = epoch_permutation(len(self.examples), self.seed, self.epoch, self.shuffle)

    @classmethod
    def from_state(
        cls, examples: Iterable[Example], state: dict[str, int], *, batch_size: int, shuffle: bool = True
    ) -> PromptIterator:
        """A new iterator over `examples` positioned at `state` (its seed comes from the state)."""
        iterator = cls(examples, batch_size=batch_size, seed=int(state["seed"]), shuffle=shuffle)
        iterator.restore(state)
        return iterator


def split_train_eval(
    examples: Sequence[Example], *, eval_size: int, seed: int = 0, key: str = "prompt"
) -> tuple[list[Example], list[Example]]:
    """(train, eval): `eval_size` examples with distinct `key`s picked with `seed`; train is every example
    whose `key` is not among them, so no held-out prompt (even a duplicate of one) is ever trained on.
    A conversation prompt is compared by its canonical JSON (role and content of every message).
    `eval_size` 0 holds nothing out: (every example, [])."""
    distinct = sorted({_key_text(e[key]) for e in examples})
    if not 0 <= eval_size < len(distinct):
        raise ValueError(
            f"eval_size {eval_size} not in [0, {len(distinct) - 1}] ({len(distinct)} distinct {key}s)"
        )
    held_out = set(random.Random(seed).sample(distinct, eval_size))
    eval_set, seen = [], set()
    for e in examples:
        text = _key_text(e[key])
        if text in held_out and text not in seen:
            seen.add(text)
            eval_set.append(e)
    train = [e for e in examples if _key_text(e[key]) not in held_out]
    return train, eval_set


def _key_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def format_prompt(example: Example, template: str) -> str:
    """Fills a plain-text template such as "Question: {prompt}\\nAnswer:" from the example's fields
    (str.format syntax: write literal braces as {{ and }})."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    if any(name == "" or name.isdigit() for name in names):
        raise ValueError(
            f"template {template!r} has a positional field; use named fields or {{{{ }}}} for braces"
        )
    try:
        return template.format_map(example)
    except KeyError as e:
        raise KeyError(
            f"template {template!r} needs field {e.args[0]!r}; example has {sorted(example)}"
        ) from None
