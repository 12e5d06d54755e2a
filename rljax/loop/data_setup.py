"""Prompts for a run: the configured source, split into train and held-out eval examples."""

from __future__ import annotations

from rljax.config import ConfigError, DataConfig
from rljax.data import SOURCES, PromptIterator, make_source, split_train_eval

FILE_SOURCES = ("jsonl", "parquet", "hf_datasets")


def load_examples(data: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval) examples; no eval prompt ever appears in train. Errors name the data.* field (the
    source's own errors are named by `rljax.loop.inputs.resolve_examples`)."""
    if data.source not in SOURCES:
        raise ConfigError(
            "data.source", f"unknown source {data.source!r}; valid: {', '.join(SOURCES.names())}"
        )
    if data.source in FILE_SOURCES:
        if not data.path:
            raise ConfigError("data.path", f"the {data.source!r} source needs a path to a file")
        fields = {"prompt": data.prompt_field, "answer": data.answer_field}
        examples = make_source(data.source, path=data.path, fields=fields)
    else:
        examples = make_source(data.source, seed=data.seed, **dict(data.source_options))
    return split_train_eval(examples, eval_size=data.eval_size, seed=data.seed)


class PromptStream:
    """Examples one at a time in the PromptIterator's seeded epoch order, so dynamic sampling can ask for
    any number of refill prompts; `state()`/`restore()` give the exact position."""

    def __init__(self, examples: list[dict], seed: int):
        self._it = PromptIterator(examples, batch_size=1, seed=seed)

    def next_examples(self, n: int) -> list[dict]:
        return [next(self._it)[0] for _ in range(n)]

    def state(self) -> dict:
        return self._it.state()

    def restore(self, state: dict) -> None:
        self._it.restore(state)
