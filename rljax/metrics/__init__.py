"""Metrics for rljax: the schema of every metric name, the writers, status files, memory and MFU helpers.

Host side only (the layering test keeps this package out of jitted code). Typical loop use:

    logger = MetricsLogger(workdir, process_index=jax.process_index(), total_steps=cfg.trainer.steps,
                           resume_step=start_step)
    status = StatusWriter(workdir, jax.process_index())
    for step in range(start_step, cfg.trainer.steps):
        status.update(step=step, phase="rollout", policy_version=version, eta_s=logger.eta_s)
        ...
        logger.write(step, metrics)
    logger.close(); status.close()

See docs/metrics.md for every name, `python -m rljax.monitor WORKDIR` and `python -m rljax.report`.
"""

from rljax.metrics.console import ConsoleWriter, EtaEstimator, format_progress
from rljax.metrics.logger import METRICS_FILE, TENSORBOARD_DIR, MetricsLogger
from rljax.metrics.schema import SCHEMA, MetricSpec, example_names, lookup, render_table
from rljax.metrics.status import StatusWriter, atomic_write_text, is_stalled, read_statuses, status_path
from rljax.metrics.system import (
    PEAK_BF16_FLOPS,
    device_memory_gb,
    host_memory_gb,
    mfu,
    peak_flops,
    training_flops_per_token,
)
from rljax.metrics.values import StepRecord, combine_metrics, split_metrics, to_counts, to_scalar
from rljax.metrics.writers import JsonlWriter, TensorBoardWriter, WandbWriter, prepare_jsonl, read_jsonl

MetricSchema = SCHEMA  # the name the loop refers to: the table of every metric

__all__ = [
    "METRICS_FILE",
    "PEAK_BF16_FLOPS",
    "SCHEMA",
    "TENSORBOARD_DIR",
    "ConsoleWriter",
    "EtaEstimator",
    "JsonlWriter",
    "MetricSchema",
    "MetricSpec",
    "MetricsLogger",
    "StatusWriter",
    "StepRecord",
    "TensorBoardWriter",
    "WandbWriter",
    "atomic_write_text",
    "combine_metrics",
    "device_memory_gb",
    "example_names",
    "format_progress",
    "host_memory_gb",
    "is_stalled",
    "lookup",
    "mfu",
    "peak_flops",
    "prepare_jsonl",
    "read_jsonl",
    "read_statuses",
    "render_table",
    "split_metrics",
    "status_path",
    "to_counts",
    "to_scalar",
    "training_flops_per_token",
]
