"""The host loop: a short sequence of named, timed phases per step.

prompts -> rollout (vLLM) -> rewards -> trajectories (LossInputs) -> update (old/ref log-probs inside)
-> weight sync -> metrics -> checkpoint. Everything numeric is in jitted functions built once in
`rljax.loop.setup.build_run`; this module only sequences them and does the I/O.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from rljax.checkpoint import save_batch
from rljax.config import Config
from rljax.loop import rollout_phase
from rljax.loop.distributed import barrier, broadcast_tree, is_leader
from rljax.loop.evaluation import eval_due
from rljax.loop.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch
from rljax.loop.setup import Run, build_run
from rljax.metrics import peak_flops
from rljax.metrics.parameters import write_parameter_overview
from rljax.metrics.profile import StepProfiler, profile_dir
from rljax.trainer.flops import matmul_params, update_flops


def train(cfg: Config, workdir: str, examples: tuple[list[dict], list[dict]] | None = None) -> None:
    """Trains for `trainer.steps` steps in `workdir`, resuming from its latest checkpoint if any.
    `examples`: the (train, eval) examples already loaded by `rljax.loop.inputs.resolve_inputs`, if any."""
    run = build_run(cfg, workdir, examples)
    watch = PreemptionWatch()
    profiler = StepProfiler(profile_dir(workdir, jax.process_index()), cfg.metrics.profile_steps)
    phase = "failed"
    try:
        if is_leader():
            table = write_parameter_overview(run.state.params, workdir)
            print(f"rljax: parameters (also in {workdir}/parameters.txt):\n{table}", flush=True)
        if run.start_step == 0 and eval_due(cfg, 0):
            run.logger.write(0, leader_evaluate(run) | {"policy/version": 0.0})
        for step in range(run.start_step, cfg.trainer.steps):
            with profiler.step(step + 1):  # numbered as in metrics.jsonl
                run_step(run, step)
            last = step + 1 == cfg.trainer.steps
            if watch.should_stop():
                save_checkpoint(run, step + 1)
                run.checkpointer.wait()
                barrier("rljax_preempted")  # no rank exits (and ends the srun step) before all saved
                print(
                    f"rljax: preempted; saved step {step + 1}, exiting for requeue",
                    file=sys.stderr,
                    flush=True,
                )
                sys.exit(PREEMPTED_EXIT_CODE)
            if cfg.checkpoint.enabled and (last or (step + 1) % cfg.checkpoint.every_steps == 0):
                save_checkpoint(run, step + 1)
        print(f"rljax: finished {cfg.trainer.steps} steps in {run.workdir}", flush=True)
        phase = "done"
    finally:
        profiler.stop()
        watch.restore()
        run.close(phase)


def run_step(run: Run, step: int) -> dict:
    """One RL step; returns the metrics it wrote for `step + 1` (the policy version it produces)."""
    cfg, timer = run.cfg, run.timer
    leader = is_leader()
    with timer.phase("rollout"):
        groups, rollout_metrics = rollout_phase.collect(run, step) if leader else (None, {})
    with timer.phase("batch"):
        batch, batch_metrics = rollout_phase.to_loss_inputs(run, groups, step) if leader else (None, {})
        batch = broadcast_tree(batch, like=run.batch_template)
        if cfg.checkpoint.save_batches and leader:  # for `rljax.replay` of this update
            save_batch(run.workdir, step, batch)
        sharded, layout_metrics = run.prepare_batch(batch)
        batch_metrics = batch_metrics | layout_metrics
    with timer.phase("update"):
        run.state, update_metrics = run.update(run.state, sharded, run.ref_params)
    version = step + 1
    with timer.phase("weight_sync"):
        sync_metrics = run.sync_weights(version)
    if run.producer is not None:
        run.producer.set_version(version)
    metrics = rollout_metrics | batch_metrics | update_metrics | sync_metrics
    metrics["policy/version"] = float(version)
    if eval_due(cfg, version):
        with timer.phase("eval"):
            metrics |= leader_evaluate(run)
    metrics |= timer.reset()
    tokens = float(np.sum(batch.loss_mask))
    metrics["throughput/update_tokens_per_s"] = tokens / max(metrics.get("timing/update_s", 0.0), 1e-9)
    metrics |= mfu_metrics(run, batch, metrics.get("timing/update_s", 0.0))
    metrics |= run.system_metrics()
    run.logger.write(version, metrics)
    run.status.update(
        step=version,
        phase="step_done",
        policy_version=version,
        total_steps=cfg.trainer.steps,
        eta_s=run.logger.eta_s,
    )
    return metrics


def mfu_metrics(run: Run, batch, update_s: float) -> dict:
    """`perf/mfu`: the update's model FLOPs (`rljax.trainer.flops`) / (update_s x peak x devices). The
    peak is `metrics.peak_flops_per_device`, else the device kind's (`rljax.metrics.peak_flops`); with
    neither (CPU) the metric is left out."""
    peak = run.cfg.metrics.peak_flops_per_device or peak_flops(jax.devices()[0].device_kind)
    if not peak or update_s <= 0:
        return {}
    n = matmul_params(run.state.params, run.model_config)
    tokens = float(np.sum(np.asarray(batch.segment_ids) > 0))
    critic = run.state.critic_params is not None
    flops = update_flops(run.cfg, run.model_config, n, tokens, batch.segment_ids.shape[1], critic=critic)
    return {"perf/mfu": flops / (update_s * peak * jax.device_count())}


def leader_evaluate(run: Run) -> dict:
    """eval/* metrics from the leader (which owns the rollout engine); {} on other processes."""
    return run.evaluate() if is_leader() else {}


def save_checkpoint(run: Run, step: int) -> None:
    with run.timer.phase("checkpoint"):
        run.checkpointer.save(step, run.state, run.checkpoint_extra(), run.config_dict)
