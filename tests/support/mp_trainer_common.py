"""Shared by the trainer tests and the multi-process worker: tiny model, config, batch, meshes.

Everything here is deterministic in its seed so separate processes build identical inputs.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh
from jax_env import child_env

from rljax.config import Config
from rljax.trainer import TrainBatch
from rljax.types import LossInputs

ROWS, LENGTH = 16, 32
MESH_AXES = ("data", "fsdp", "tensor")


def with_fields(cfg: Config, **changes) -> Config:
    """`with_fields(cfg, algo__beta=0.1)`: a copy of the nested frozen config with fields replaced."""
    for key, value in changes.items():
        section, name = key.split("__")
        cfg = dataclasses.replace(
            cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})}
        )
    return cfg


def base_config(**changes) -> Config:
    """Every loss term on (KL to a reference, entropy bonus, token-level truncated IS), AdamW + clipping."""
    cfg = with_fields(
        Config(),
        algo__beta=0.05,
        algo__entropy_coef=0.01,
        algo__is_level="token",
        algo__is_cap=1.5,
        algo__clip_high=0.28,
        optim__learning_rate=1e-3,
        optim__max_grad_norm=1.0,
        optim__weight_decay=0.01,
        trainer__logprob_impl="xla",
        rollout__batch_size=ROWS,
        rollout__group_size=4,
    )
    return with_fields(cfg, **changes)


def mesh_of(devices, data: int = 1, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """A (data, fsdp, tensor) mesh over the given devices (in order)."""
    return Mesh(np.asarray(devices[: data * fsdp * tensor]).reshape(data, fsdp, tensor), MESH_AXES)


def loss_inputs(seed: int, vocab: int, rows: int = ROWS, length: int = LENGTH) -> LossInputs:
    """Random padded prompt+completion rows obeying the LossInputs contract (behavior_logp zero)."""
    rng = np.random.default_rng(seed)
    sequences, prompts = [], []
    for _ in range(rows):
        prompt = int(rng.integers(2, 8))
        total = int(rng.integers(prompt + 3, length + 1))
        sequences.append(rng.integers(3, vocab, size=total).astype(np.int32))
        prompts.append(prompt)
    return rows_loss_inputs(sequences, prompts, rng, length)


def rows_loss_inputs(sequences, prompts, rng, length: int = LENGTH) -> LossInputs:
    """One row per token array of `sequences` (its first `prompts[r]` tokens the prompt), padded to
    `length`; random advantages and 0/1 rewards drawn from `rng`, groups of 4 rows, behavior_logp zero."""
    rows = len(sequences)
    z = lambda dt: np.zeros((rows, length), dt)  # noqa: E731
    ids, tgt, pos, seg, mask = z(np.int32), z(np.int32), z(np.int32), z(np.int32), z(np.float32)
    for r, (toks, prompt) in enumerate(zip(sequences, prompts, strict=True)):
        total = len(toks)
        ids[r, :total], seg[r, :total], pos[r, :total] = toks, 1, np.arange(total)
        tgt[r, : total - 1] = toks[1:]
        mask[r, prompt - 1 : total - 1] = 1.0
    return LossInputs(
        input_ids=ids,
        target_ids=tgt,
        positions=pos,
        segment_ids=seg,
        loss_mask=mask,
        behavior_logp=np.zeros((rows, length), np.float32),
        advantages=rng.normal(size=rows).astype(np.float32),
        rewards=rng.integers(0, 2, size=rows).astype(np.float32),
        group_ids=(np.arange(rows) // 4).astype(np.int32),
        policy_version=np.zeros(rows, np.int32),
    )


def off_policy_batch(inputs: LossInputs, logp: np.ndarray, seed: int) -> TrainBatch:
    """Host TrainBatch whose old/ref/behaviour log-probs are the current ones perturbed, so that ratios
    leave the clip range and IS weights hit the cap (every code path of the loss is exercised)."""
    rng = np.random.default_rng(seed + 1)
    noise = lambda s: (rng.normal(size=logp.shape) * s).astype(np.float32)  # noqa: E731
    old = np.minimum(logp + noise(0.3), 0.0).astype(np.float32)
    behavior = np.minimum(old + noise(0.5), 0.0) * inputs.loss_mask
    ref = np.minimum(logp + noise(0.2), 0.0).astype(np.float32)
    inputs = inputs.replace(behavior_logp=behavior.astype(np.float32))
    return TrainBatch(inputs=inputs, old_logp=old, advantages=inputs.advantages, ref_logp=ref)


def to_host(tree):
    """Fully replicated / addressable global arrays -> numpy (float64 for comparisons)."""
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


def max_rel_diff(a, b) -> float:
    """max over leaves of ||a - b|| / max(||b||, tiny) (norm-wise relative error per leaf)."""
    diffs = jax.tree.map(
        lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)), to_host(a), to_host(b)
    )
    return max(jax.tree.leaves(diffs))


# Two runs' updated params differ by their updates' difference: measured against the update's own size
# (not the params' norm, which a small step leaves almost unchanged). Adam's first step is
# lr * g / (|g| + eps) per element: sign-like where |g| >> eps, but linear in g where |g| is near eps, and
# there it carries the element's own relative error, far above the gradients' norm-wise 1e-5 (sharded
# reductions change the float32 summation order). Measured on the 8-device and 2-process runs: 1.05e-3 of
# the step (AMD EPYC). 1e-2 leaves 10x for other hosts' summation orders. The gradients themselves are
# compared at 1e-5 beside it (Adam's sign-like step would hide a gradient's scale); this bound catches an
# update that is wrongly applied or sharded (a leaf's step on the wrong shard or not at all is O(1)).
STEP_RTOL = 1e-2


def max_step_rel_diff(new, ref_new, old) -> float:
    """max over leaves of ||new - ref_new|| / ||ref_new - old||: two updates from `old` compared
    against the reference update's size (norm-wise, per leaf)."""
    new, ref_new, old = to_host(new), to_host(ref_new), to_host(old)
    diffs = jax.tree.map(
        lambda x, y, o: float(np.linalg.norm(x - y) / max(np.linalg.norm(y - o), 1e-30)), new, ref_new, old
    )
    return max(jax.tree.leaves(diffs))


@dataclasses.dataclass
class Reference:
    """The single-device run every equivalence test compares against (host values)."""

    ckpt: str
    cfg: Config
    model_config: object
    params: dict  # host numpy, as loaded
    batch: TrainBatch  # host numpy
    mesh: Mesh
    step: object  # compiled single-device train step
    logp: np.ndarray
    grads: dict
    grad_metrics: dict
    new_params: dict
    metrics: dict


def build_checkpoint(path: str) -> str:
    from rljax.models.tiny import build_tiny_checkpoint

    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_checkpoint(path, "qwen2", seed=3)
    return path


def load(path: str, mesh: Mesh | None = None):
    """(ModelConfig, params) of the tiny checkpoint at `path`: host numpy, or global arrays on `mesh`."""
    from rljax import models

    model_config, params = models.load_hf_checkpoint(path, mesh=mesh)
    return model_config, params if mesh is not None else jax.tree.map(np.asarray, params)


@functools.cache
def tiny_model() -> tuple[str, object, dict]:
    """(checkpoint dir, ModelConfig, host params) of the tiny Qwen2 model (built once per process)."""
    root = tempfile.mkdtemp(prefix="rljax_trainer_")
    atexit.register(shutil.rmtree, root, True)
    ckpt = build_checkpoint(os.path.join(root, "tiny"))
    return (ckpt, *load(ckpt))


@functools.cache
def reference_run() -> Reference:
    """Runs logp, grads and one step of the tiny model on one device (once per process)."""
    from rljax import trainer
    from rljax.trainer.step import make_grad_fn

    ckpt, model_config, params = tiny_model()
    cfg, mesh = base_config(), mesh_of(jax.devices(), 1, 1, 1)
    inputs = loss_inputs(0, model_config.vocab_size)
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    logp, _ = trainer.make_logprob_fn(cfg, model_config, mesh)(
        state.params, trainer.shard_batch(inputs, mesh)
    )
    batch = off_policy_batch(inputs, np.asarray(logp), 0)
    grads, grad_metrics = make_grad_fn(cfg, model_config, mesh)(
        state.params, trainer.shard_batch(batch, mesh)
    )
    step = trainer.make_train_step(cfg, model_config, mesh)
    new_state, metrics = step(state, trainer.shard_batch(batch, mesh))
    return Reference(
        ckpt=ckpt,
        cfg=cfg,
        model_config=model_config,
        params=params,
        batch=batch,
        mesh=mesh,
        step=step,
        logp=np.asarray(logp),
        grads=to_host(grads),
        grad_metrics=to_host(grad_metrics),
        new_params=to_host(new_state.params),
        metrics=to_host(metrics),
    )


def counting_logprob_fn(make_logprob_fn, calls: list):
    """A `make_logprob_fn` whose functions append each call's sequence length to `calls` (the single
    canary path tests: every call into the training path's log-prob function is counted). Only the
    global shape is read, so it works on arrays that span processes."""

    def counted(*a, **k):
        fn = make_logprob_fn(*a, **k)

        def call(params, batch):
            calls.append(int(batch.input_ids.shape[-1]))
            return fn(params, batch)

        return call

    return counted


def save_pickle(obj, path: str) -> None:
    """Host values (numpy trees, dataclasses) to a file written by this test session only."""
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def load_pickle(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)


def run_two_processes(worker: str, args: list[str], log_dir, timeout_s: float) -> None:
    """`python WORKER <process id> <port> *args` for process ids 0 and 1 (a fresh jax.distributed port);
    if one fails or the time runs out, the other is stopped (a survivor would wait for its peer). Asserts
    both exit 0, with the tail of each worker's log (`log_dir/worker<i>.log`) in the message."""
    from rljax.rollout.server import free_port

    port = str(free_port())
    env = child_env()
    procs, logs = [], []
    for i in range(2):
        log = open(log_dir / f"worker{i}.log", "w+")  # noqa: SIM115 (closed below)
        cmd = [sys.executable, worker, str(i), port, *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read()[-4000:])
        log.close()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"worker exit codes {codes}\n" + "\n----\n".join(texts)
