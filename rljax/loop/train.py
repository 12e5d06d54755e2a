"""The host loop: one function, `loop`, whose body is the step's named, timed phases in order.

rollout (vLLM, rewards) -> batch (trajectories -> LossInputs, sharded) -> update (old/ref log-probs
inside) -> weight sync -> eval -> log, then checkpoint. The train state is passed to the update and
returned from it; everything numeric is in jitted functions built once in `rljax.loop.setup.build_run`,
and each phase below gets only the part (`Sampler`, `Trainer`, `Collector`, `RunIO`) it uses.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from rljax import models
from rljax.checkpoint import save_batch
from rljax.config import Config
from rljax.distributed import barrier, broadcast_tree, is_leader, to_host
from rljax.loop import rollout_phase
from rljax.loop.async_rollout import AsyncProducer
from rljax.loop.engine import push_params
from rljax.loop.evaluation import Evaluator, eval_due
from rljax.loop.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch
from rljax.loop.rollout_phase import Collector
from rljax.loop.setup import Run, RunIO, Trainer, build_run
from rljax.metrics import device_memory_gb, host_memory_gb, peak_flops
from rljax.metrics.parameters import write_parameter_overview
from rljax.metrics.profile import StepProfiler, profile_dir
from rljax.models import ModelConfig, lora
from rljax.sampling import Engine, SamplingOptions, Weights
from rljax.trainer.flops import matmul_params, update_flops
from rljax.trainer.state import TrainState
from rljax.trajectory import Group
from rljax.types import LossInputs


def train(cfg: Config, workdir: str, examples: tuple[list[dict], list[dict]] | None = None) -> None:
    """Trains for `trainer.steps` steps in `workdir`, resuming from its latest checkpoint if any.
    `examples`: the (train, eval) examples already loaded by `rljax.loop.inputs.resolve_inputs`, if any."""
    run, state, start = build_run(cfg, workdir, examples)
    watch = PreemptionWatch()
    profiler = StepProfiler(profile_dir(workdir, jax.process_index()), cfg.metrics.profile_steps)
    phase = "failed"
    try:
        if is_leader():
            table = write_parameter_overview(state.params, workdir)
            print(f"rljax: parameters (also in {workdir}/parameters.txt):\n{table}", flush=True)
        if start == 0 and eval_due(cfg, 0):
            run.io.logger.write(0, leader_evaluate(run.evaluator) | {"policy/version": 0.0})
        loop(run, state, start, watch, profiler)
        print(f"rljax: finished {cfg.trainer.steps} steps in {workdir}", flush=True)
        phase = "done"
    finally:
        profiler.stop()
        watch.restore()
        run.close(phase)


def loop(
    run: Run, state: TrainState, start: int, watch: PreemptionWatch, profiler: StepProfiler
) -> TrainState:
    """Steps `start` .. `trainer.steps - 1`; step s trains policy version s + 1 (metrics.jsonl's step)."""
    cfg, timer = run.cfg, run.io.timer
    for step in range(start, cfg.trainer.steps):
        version = step + 1
        with profiler.step(version):
            with timer.phase("rollout"):
                groups, rollout_metrics = collect(run.collector, run.producer, step, run.sampler.engine)
            with timer.phase("batch"):
                batch, sharded, batch_metrics = make_batch(
                    cfg, run.trainer, run.sampler.options, run.io.workdir, groups, step
                )
            with timer.phase("update"):
                state, update_metrics = run.trainer.update(state, sharded, run.trainer.ref_params)
            with timer.phase("weight_sync"):
                served_now = eval_due(cfg, version) or version == cfg.trainer.steps
                sync_metrics = sync_weights(
                    run.sampler.engine, run.weights, run.producer, state, version, served_now
                )
            metrics = rollout_metrics | batch_metrics | update_metrics | sync_metrics
            metrics["policy/version"] = float(version)
            if eval_due(cfg, version):
                with timer.phase("eval"):
                    metrics |= leader_evaluate(run.evaluator)
            log_step(cfg, run.io, run.trainer.model_config, state, batch, version, metrics)
        if watch.should_stop():
            preempt(run, state, version)
        if cfg.checkpoint.enabled and (
            version == cfg.trainer.steps or version % cfg.checkpoint.every_steps == 0
        ):
            save_checkpoint(run, state, version)
    return state


def collect(
    collector: Collector, producer: AsyncProducer | None, step: int, engine: Engine
) -> tuple[list[Group] | None, dict]:
    """The groups trained on at `step` (leader only): generated now (sync) or taken from the async buffer.
    A producer that failed because a background push failed (the gate it left broken) reports the push's
    own error (`engine.wait_pushed`)."""
    if not is_leader():
        return None, {}
    if producer is None:
        return rollout_phase.select_groups(collector, step)
    try:
        return producer.take(step)
    except RuntimeError:
        engine.wait_pushed()  # raises a failed background push's error, if that was the cause
        raise


def make_batch(
    cfg: Config,
    trainer: Trainer,
    options: SamplingOptions,
    workdir: str,
    groups: list[Group] | None,
    step: int,
) -> tuple[LossInputs, LossInputs, dict]:
    """(batch, sharded batch, metrics): the leader builds the LossInputs, every process receives it
    (`broadcast_tree`) and lays it out and shards it the same way."""
    leader = is_leader()
    batch, metrics = None, {}
    if leader:
        batch, metrics = rollout_phase.to_loss_inputs(
            groups,
            step,
            advantages=trainer.advantages,
            options=options,
            vocab_size=trainer.model_config.vocab_size,
        )
    batch = broadcast_tree(batch, like=trainer.batch_template)
    if cfg.checkpoint.save_batches and leader:  # for `rljax.replay` of this update
        save_batch(workdir, step, batch)
    sharded, layout_metrics = trainer.prepare_batch(batch)
    return batch, sharded, metrics | layout_metrics


def sync_weights(
    engine: Engine,
    weights: Weights,
    producer: AsyncProducer | None,
    state: TrainState,
    version: int,
    served_now: bool,
) -> dict:
    """Serves `state.params` as policy `version`; the async producer may then run ahead from it.

    The push goes one way: `weights.snapshot(params)` (the trainer's side), then the engine pushes that
    snapshot. Sync mode (and multi-process runs): delivered before this returns (`push_params`). Async
    mode in one process: the snapshot's trainer side is done here and the rest is delivered in the
    background (`engine.start_push`), the producer told when it is served; `served_now` (an evaluation
    or the run's end follows) waits for it. Returns the weight_sync/* of the pushes delivered since the
    previous step (async: usually the previous step's)."""
    if producer is not None:
        producer.await_generator_of(version)
    if producer is None or jax.process_count() > 1:
        metrics = push_params(engine, weights, state.params, version)
        if producer is not None:
            producer.set_version(version)
        return metrics
    with weights.snapshot(state.params) as snapshot:
        engine.start_push(snapshot, version, on_served=producer.set_version)
    if served_now:
        engine.wait_pushed()
    return engine.pushed_metrics()


def leader_evaluate(evaluator: Evaluator) -> dict:
    """eval/* metrics from the leader (which owns the rollout engine); {} on other processes."""
    return evaluator() if is_leader() else {}


def log_step(
    cfg: Config,
    io: RunIO,
    model_config: ModelConfig,
    state: TrainState,
    batch: LossInputs,
    version: int,
    metrics: dict,
) -> None:
    """Adds the step's timings, throughput, MFU and memory to `metrics`, writes them as step `version`
    and updates the status file."""
    metrics |= io.timer.reset()
    update_s = metrics.get("timing/update_s", 0.0)
    tokens = float(np.sum(batch.loss_mask))
    metrics["throughput/update_tokens_per_s"] = tokens / max(update_s, 1e-9)
    metrics |= mfu_metrics(cfg, model_config, state, batch, update_s)
    metrics |= system_metrics()
    io.logger.write(version, metrics)
    io.status.update(
        step=version,
        phase="step_done",
        policy_version=version,
        total_steps=cfg.trainer.steps,
        eta_s=io.logger.eta_s,
    )


def mfu_metrics(
    cfg: Config, model_config: ModelConfig, state: TrainState, batch: LossInputs, update_s: float
) -> dict:
    """`perf/mfu`: the update's model FLOPs (`rljax.trainer.flops`) / (update_s x peak x devices). The
    peak is `metrics.peak_flops_per_device`, else the device kind's (`rljax.metrics.peak_flops`); with
    neither (CPU) the metric is left out."""
    peak = cfg.metrics.peak_flops_per_device or peak_flops(jax.devices()[0].device_kind)
    if not peak or update_s <= 0:
        return {}
    # LoRA: the state holds the adapter; N is the base model's
    params = (
        models.abstract_params(lora.base_config(model_config)) if model_config.lora_rank else state.params
    )
    n = matmul_params(params, model_config)
    tokens = float(np.sum(np.asarray(batch.segment_ids) > 0))
    critic = state.critic_params is not None
    flops = update_flops(cfg, model_config, n, tokens, batch.segment_ids.shape[1], critic=critic)
    return {"perf/mfu": flops / (update_s * peak * jax.device_count())}


def system_metrics() -> dict:
    out = {"memory/host_rss_gb": host_memory_gb()}
    peak = device_memory_gb()
    if peak is not None:
        out["memory/device_peak_gb"] = peak
    return out


def checkpoint_extra(run: Run, state: TrainState) -> dict:
    """data position, policy version, and (async) the buffered batches, consistent with each other."""
    extra = {"policy_version": int(to_host(state.step)), "seed": run.cfg.trainer.seed}
    if run.producer is None:
        return extra | {"data": run.collector.prompts.state()}
    snapshot = run.producer.snapshot()
    return extra | {"data": snapshot["data"], "buffer": snapshot}


def save_checkpoint(run: Run, state: TrainState, step: int) -> None:
    with run.io.timer.phase("checkpoint"):
        run.io.checkpointer.save(step, state, checkpoint_extra(run, state), run.io.config_dict)


def preempt(run: Run, state: TrainState, step: int) -> None:
    """Saves `step`, waits until every process has saved, and exits for requeue (PREEMPTED_EXIT_CODE)."""
    save_checkpoint(run, state, step)
    run.io.checkpointer.wait()
    barrier("rljax_preempted")  # no rank exits (and ends the srun step) before all saved
    print(f"rljax: preempted; saved step {step}, exiting for requeue", file=sys.stderr, flush=True)
    sys.exit(PREEMPTED_EXIT_CODE)
