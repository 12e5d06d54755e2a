"""The host loop's control flow (`rljax.loop.train.loop`) over the run's parts: the train state is threaded
through update -> weight sync -> checkpoint, phases are timed in order, eval and checkpoints come when
due, and one metrics line is written per step. The generator, the update and the engine are narrow fakes
(control flow only); the Sampler, Trainer, Collector, RunIO and writers are the real types, and the batch
is built by the real `to_loss_inputs`. The proof with vLLM and orbax is tests/loop/test_loop_grpo.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import numpy as np
import pytest
from mp_trainer_common import with_fields

from rljax.config import Config
from rljax.loop import train
from rljax.loop.data_setup import PromptStream
from rljax.loop.evaluation import NO_EVAL
from rljax.loop.phases import PhaseTimer
from rljax.loop.rollout_phase import make_collector
from rljax.loop.setup import Run, RunIO, Trainer, batch_template, make_advantages, make_writers
from rljax.models import ModelConfig
from rljax.sampling import Sampler, SamplingOptions
from rljax.trainer.state import TrainState
from rljax.trajectory import Group, Trajectory
from rljax.weight_sync import WeightSyncError


class Engine:
    """Records which params each policy version was served with."""

    def __init__(self, version: int):
        self.version = version
        self.pushed: list[tuple[int, float]] = []

    def push_weights(self, params, version):
        self.version = version
        self.pushed.append((version, float(params["w"][0])))
        return {"weight_sync/bytes": 8.0}


class Weights:
    """Params as their own snapshot (the fake engine reads them)."""

    def snapshot(self, params):
        return contextlib.nullcontext(params)

    def close(self):
        pass


class Checkpoints:
    """Records saves (step, state step, extra); orbax itself is tested in tests/test_checkpoint*.py."""

    def __init__(self):
        self.saved: list[tuple[int, int, dict]] = []

    def save(self, step, state, extra, config):
        self.saved.append((step, int(state.step), extra))

    def wait(self):
        pass

    def close(self):
        pass


class NeverStop:
    def should_stop(self) -> bool:
        return False


class NoProfiler:
    def step(self, number: int):
        return contextlib.nullcontext()


def generate(sampler, examples, seed):
    """Two samples per prompt with rewards 0 and 1, sampled by the currently served version."""
    version = sampler.engine.version
    groups = []
    for ex in examples:
        trajs = [Trajectory([1, 2], [3, 4], [-0.5, -0.5], float(r), 0, version) for r in (0, 1)]
        groups.append(Group(ex, trajs, {"fn": np.asarray([0.0, 1.0], np.float32)}))
    return groups, {"rollout/generated_tokens": 4.0 * len(examples)}


def make_run(cfg: Config, workdir, start: int) -> Run:
    options = SamplingOptions(2, 1.0, 1.0, 0, 4, (0,), 32)
    # No tokenizer, renderer or reward pool: the fake generator above uses none of them.
    sampler = Sampler(None, Engine(start), None, None, lambda lengths: np.zeros(len(lengths)), options)

    def update(state, batch, ref_params):
        assert ref_params is None and batch.input_ids.shape[0] == cfg.rollout.batch_size
        new = state.replace(step=state.step + 1, params={"w": state.params["w"] + 1.0})
        return new, {"loss/total": 0.5}

    model_config = ModelConfig("qwen2", 64, 32, 64, 1, 2, 1, 16)
    trainer = Trainer(
        model_config, None, update, lambda b: (b, {}), make_advantages(cfg), None, batch_template(cfg)
    )
    prompts = PromptStream([{"prompt": str(i)} for i in range(16)], seed=0)
    collector = dataclasses.replace(make_collector(cfg, sampler, prompts), generate=generate)
    logger, status = make_writers(cfg, str(workdir), 0)
    io = RunIO(str(workdir), logger, status, Checkpoints(), PhaseTimer(), {})
    return Run(cfg, sampler, trainer, collector, None, NO_EVAL, io, Weights())


def test_loop_threads_the_state_through_the_phases(tmp_path):
    cfg = with_fields(
        Config(),
        rollout__batch_size=4,
        rollout__group_size=2,
        trainer__steps=3,
        trainer__eval_every=2,
        checkpoint__every_steps=2,
        metrics__tensorboard=False,
        metrics__console=False,
    )
    run = make_run(cfg, tmp_path, start=1)
    state = TrainState(np.int32(1), {"w": np.zeros(1)}, (), np.int32(0))  # as if resumed at step 1
    final = train.loop(run, state, 1, NeverStop(), NoProfiler())
    assert int(final.step) == 3 and float(final.params["w"][0]) == 2.0  # steps 1 and 2 ran
    # Version v is served with the params after v updates of this run (w counts this run's updates).
    assert run.sampler.engine.pushed == [(2, 1.0), (3, 2.0)]
    saved = run.io.checkpointer.saved
    assert [(s, n) for s, n, _ in saved] == [(2, 2), (3, 3)]  # every 2 steps and the last
    assert [e["policy_version"] for _, _, e in saved] == [2, 3] and all("data" in e for _, _, e in saved)
    run.io.logger.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 3] and [m["policy/version"] for m in lines] == [2.0, 3.0]
    for m in lines:
        assert m["loss/total"] == 0.5 and m["weight_sync/bytes"] == 8.0 and m["reward/mean"] == 0.5
        assert m["staleness/max"] == 0.0  # sampled by the version served before this step's update
        phases = [k[len("timing/") : -2] for k in m if k.startswith("timing/")]
        assert phases[-6:] == ["rollout", "batch", "update", "weight_sync", "eval", "step"]  # both eval
    # The save after version 2 is timed in the next step (as every phase outside a step's own).
    assert "timing/checkpoint_s" not in lines[0] and "timing/checkpoint_s" in lines[1]


def test_a_producer_failed_by_a_background_push_reports_the_push_error():
    """Async mode: a failed background push leaves the gate broken, so the producer fails first; the step
    reports the push's own error, and the producer's when no push failed."""

    class Producer:
        def take(self, step):
            raise RuntimeError("async rollout producer failed: the servers may hold mixed weights")

    class PushFailed:
        def wait_pushed(self):
            raise WeightSyncError("canary prompt_logprobs on http://x: differ by max 0.3")

    class PushFine:
        def wait_pushed(self):
            pass

    with pytest.raises(WeightSyncError, match="canary prompt_logprobs"):
        train.collect(None, Producer(), 3, PushFailed())
    with pytest.raises(RuntimeError, match="async rollout producer failed"):
        train.collect(None, Producer(), 3, PushFine())
