"""The Sampler: everything that turns prompts into scored completions, built once per run.

`Sampler` bundles the tokenizer, the rollout engine, the prompt renderer, the reward scorer, the length
shaping and the sampling options (`SamplingOptions`, from `cfg.rollout`). The single-turn rollout
(`rljax.loop.rollout_phase.generate_groups`), the multi-turn environments (`rljax.envs`) and held-out
evaluation take a Sampler, never the whole run. The engine, scorer, tokenizer and renderer are typed by
the protocols below (what the rollout code calls on them), so this module imports no side-effect package
and `rljax.envs` can use it without importing the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class Completion(Protocol):
    """One sample as the engine returns it (`rljax.rollout.client.Completion`)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str  # "stop" or "length"
    policy_version: int  # the weights version that sampled it
    prompt_index: int  # position of its prompt in the request
    sample_index: int  # 0 .. n-1 within its prompt


class Engine(Protocol):
    """The rollout engine (`rljax.loop.engine.make_engine`): samples and receives weights."""

    def generate(self, prompts: list[list[int]], **sampling: Any) -> list[Completion]: ...

    def push_weights(self, snapshot: Any, version: int) -> dict[str, float]:
        """Serves `snapshot` (`Weights.snapshot(params)`) as policy `version`; returns the sync's metrics."""
        ...

    def start_push(self, snapshot: Any, version: int, on_served: Any = None) -> None:
        """`push_weights` delivered in the background (async mode); `on_served(version)` when served."""
        ...

    def wait_pushed(self) -> None:
        """Waits for the push `start_push` began; raises its failure."""
        ...

    def pushed_metrics(self) -> dict[str, float]:
        """The metrics of the `start_push` pushes delivered since the last call."""
        ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class Weights(Protocol):
    """The trainer's side of a weight push (`rljax.loop.engine.JaxWeights`, `ShardedJaxWeights`)."""

    def snapshot(self, params: Any) -> Any:
        """`params` (a parameter pytree) as one version for `Engine.push_weights`; a context manager
        (`with snapshot:` ends the push on the trainer's side)."""
        ...

    def close(self) -> None: ...


class Scorer(Protocol):
    """Reward functions over {"prompt", "completion", "example"} items (`rljax.rewards.RewardPool`)."""

    def score(
        self, items: list[dict[str, Any]]
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """(rewards f32[N], per-function rewards {name: f32[N]}, metrics)."""
        ...

    def close(self) -> None: ...


class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer the rollout code uses."""

    eos_token_id: int

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Mapping[str, list[int]]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Renderer(Protocol):
    """An example's prompt (`rljax.data.make_prompt_renderer`): as text and as token ids."""

    def text(self, example: dict[str, Any]) -> str: ...

    def ids(self, example: dict[str, Any]) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """`cfg.rollout`'s sampling settings, resolved once (stop tokens default to the tokenizer's EOS)."""

    group_size: int  # completions per prompt
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int  # per completion (per model turn in multi-turn episodes)
    stop_token_ids: tuple[int, ...]
    max_sequence_length: int  # prompt + completion, the server's max_model_len

    def request(self, *, n: int, seed: int, max_tokens: int | None = None, stop_token_ids=None) -> dict:
        """Keyword arguments of `Engine.generate` for `n` samples per prompt."""
        return {
            "n": n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
            "stop_token_ids": self.stop_token_ids if stop_token_ids is None else stop_token_ids,
            "seed": seed,
        }


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Prompts in, scored completions out. `rewards` is None on processes other than the leader (only
    the leader samples); `length_shaping(lengths) -> f32[B]` is added to every reward (DAPO overlong)."""

    tokenizer: Tokenizer
    engine: Engine
    renderer: Renderer
    rewards: Scorer | None
    length_shaping: Callable[[list[int]], np.ndarray]
    options: SamplingOptions

    def encode_prompt(self, example: dict[str, Any]) -> list[int]:
        return self.renderer.ids(example)

    def prompt_text(self, example: dict[str, Any]) -> str:
        return self.renderer.text(example)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens in it parsed as such), no BOS added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
