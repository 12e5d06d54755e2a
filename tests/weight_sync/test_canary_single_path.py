"""One canary scorer in every layout: the training path's log-prob function (`trainer.make_logprob_fn`,
compute dtype, `trainer.logprob_impl`, sharded params) and nothing else (issue 16).

Every call into the training-path function is counted (it is wrapped where `rljax.trainer` exports it)
while the canary's trainer side answers in a single process (with its early forward), in
both multi-process layouts of `ShardedJaxWeights` (2 processes x 4 CPU devices: trainers on several hosts,
and on one host) and in a recovery's re-push (the kept answers, no forward at all).
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import models, trainer
from rljax.config import Config
from rljax.loop import engine
from rljax.weight_sync import WeightSyncError
from rljax.weight_sync.canary import make_canary

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from rljax.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("m"), "qwen2", seed=5)


def counted_training_path(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(trainer, "make_logprob_fn", C.counting_logprob_fn(trainer.make_logprob_fn, calls))
    return calls


def test_single_process_canary_is_the_training_path(tiny_ckpt, monkeypatch):
    calls = counted_training_path(monkeypatch)
    cfg, mesh = Config(), C.mesh_of(jax.devices(), 1, 1, 1)
    model_config, params = models.load_hf_checkpoint(tiny_ckpt, mesh=mesh, dtype=jnp.float32)
    canary = engine.make_canary_logprobs(cfg, model_config, mesh, data_parallel=1)
    spec = make_canary(model_config.vocab_size, prompt_len=20, completion_len=6)
    prompt, fixed = list(spec.prompt_ids), list(spec.completion_ids)
    other = [(fixed[0] + 1) % model_config.vocab_size, *fixed[1:]]
    weights, seen = engine.JaxWeights(model_config, canary, spec), {}
    snapshot = weights.snapshot(params)
    assert len(calls) == 1  # the early forward was dispatched when the snapshot was taken
    # what check_canary asks, then what the engine keeps for a recovery
    seen["answer"], seen["kept"] = snapshot.logprobs(prompt, fixed), snapshot.keep()
    assert len(calls) == 1  # the canary's fixed question: answered by the early forward alone
    direct = trainer.make_logprob_fn  # the counted training path itself, scored here for the reference
    scorer = engine.CanaryScorer(direct(cfg, model_config, mesh), mesh, 1, params)
    reference = scorer(prompt, fixed)
    np.testing.assert_array_equal(seen["answer"], reference)
    n = len(calls)
    np.testing.assert_array_equal(seen["kept"].logprobs(prompt, fixed), reference)
    assert len(calls) == n  # a recovery's re-push is checked against the push's own answers
    with pytest.raises(WeightSyncError, match="did not see"):
        seen["kept"].logprobs(prompt, other)
    early = weights.snapshot(params).logprobs  # its forward dispatched, not yet asked
    n = len(calls)
    np.testing.assert_array_equal(early(prompt, other), scorer(prompt, other))  # other tokens: scored
    assert len(calls) == n + 2  # by the same training path (the early one's and the reference's)


@pytest.mark.timeout(600)
def test_multi_process_canary_is_the_training_path(tiny_ckpt, tmp_path):
    worker = str(ROOT / "tests" / "support" / "mp_canary_worker.py")
    C.run_two_processes(worker, [str(tiny_ckpt), str(tmp_path)], tmp_path, timeout_s=540)
    out0, out1 = (C.load_pickle(str(tmp_path / f"canary{i}.pkl")) for i in range(2))
    for name in ("multi_host", "one_host"):
        assert out0["calls"][name] == out1["calls"][name] == 1  # one sharded forward, every process
        assert out0["calls"][name + "_recovery"] == 0
        np.testing.assert_array_equal(out0["answers"][name], out0["direct"])
        np.testing.assert_array_equal(out0["kept"][name], out0["direct"])
    assert np.all(np.isfinite(out0["direct"])) and np.all(out0["direct"] < 0)


def test_rljax_has_one_canary_scorer():
    """Static: the only log-prob forward outside the trainer and the models is the training path's."""
    forward = re.compile(r"\b(hidden_states|token_logprobs|unembed_matrix|forward_logits)\(")
    offenders = []
    for path in sorted((ROOT / "rljax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("rljax/trainer/", "rljax/models/", "rljax/kernels/")):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if forward.search(line) and not line.lstrip().startswith(("def ", "#")):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert offenders == []
    source = (ROOT / "rljax" / "loop" / "engine.py").read_text()
    assert source.count("trainer.make_logprob_fn(") == 1
    for gone in ("local_logprobs", "_local_token_logprobs", "_greedy_then_logprobs"):
        assert gone not in source
