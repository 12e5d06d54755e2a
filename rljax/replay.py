"""`python -m rljax.replay --workdir=DIR --step=S`: re-runs one saved update and checks it bit for bit.

Restores checkpoint S of a run (made with `--config.checkpoint.save_batches=true`), loads the batch that
run trained on from S (`DIR/batches/step_<S>.npz`), runs the same jitted update with the run's saved
config, and compares the whole train state (params, optimizer state, counters) with checkpoint S+1.
Prints one line; exits 0 when every leaf is bitwise identical, 1 on a mismatch (naming the first
differing leaf), 2 on bad input (no such workdir, checkpoint, or saved batch). Replay on the device
layout the run used: XLA promises identical bits only for the same program on the same hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.runtime import fail


@dataclasses.dataclass(frozen=True)
class Verdict:
    match: bool
    leaves: int
    first_mismatch: str = ""  # the key path of the first differing leaf
    detail: str = ""


def compare_trees(got: Any, want: Any) -> Verdict:
    """Bitwise comparison leaf by leaf (NaNs equal iff their bits are); structure must agree."""
    import jax

    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    if got_def != want_def:
        return Verdict(False, len(want_leaves), "<tree structure>", f"{got_def} != {want_def}")
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        name = jax.tree_util.keystr(path)
        if a.shape != b.shape or a.dtype != b.dtype:
            return Verdict(False, len(want_leaves), name, f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}")
        if a.tobytes() != b.tobytes():
            bits_a = a.reshape(a.size, 1).view(np.uint8)  # one row of raw bytes per element
            bits_b = b.reshape(b.size, 1).view(np.uint8)
            count = int((bits_a != bits_b).any(axis=1).sum())
            diff = np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)
            return Verdict(
                False, len(want_leaves), name, f"{count} of {a.size} elements differ, max |diff| {diff:.3g}"
            )
    return Verdict(True, len(want_leaves))


def check_inputs(workdir: str, step: int) -> tuple[str, str]:
    """(checkpoint directory, batch file) after checking both exist; exits 2 naming what is missing."""
    from rljax.checkpoint import batch_path

    if not os.path.isdir(workdir):
        fail(f"--workdir: no such directory: {workdir!r}")
    if step < 0:
        fail(f"--step: must be >= 0, got {step}")
    ckpt_dir = os.path.join(workdir, "checkpoints")
    steps = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if os.path.isdir(ckpt_dir) else []
    for s in (step, step + 1):
        if s not in steps:
            fail(
                f"--step: replaying step {step} needs checkpoints {step} and {step + 1} in {ckpt_dir}; "
                f"found {steps or 'none'} (save every step with --config.checkpoint.every_steps=1)"
            )
    batch = batch_path(workdir, step)
    if not os.path.isfile(batch):
        fail(
            f"--step: no saved batch for step {step} ({batch}); "
            "run with --config.checkpoint.save_batches=true"
        )
    return ckpt_dir, batch


def replay(workdir: str, step: int) -> Verdict:
    """Restores checkpoint `step`, re-runs its update on the saved batch, compares with `step + 1`."""
    import jax

    from rljax import config as config_lib
    from rljax import trainer
    from rljax.checkpoint import Checkpointer, abstract_like, load_batch, saved_run_config
    from rljax.loop.setup import load_policy
    from rljax.sharding import make_mesh

    ckpt_dir, batch_file = check_inputs(workdir, step)
    checkpointer = Checkpointer(ckpt_dir, async_save=False)
    try:
        cfg = config_lib.from_config_dict(saved_run_config(checkpointer.restore_config(step))[0])
        mesh = make_mesh(**config_lib.mesh_shape(cfg.mesh, jax.device_count()))
        model_config, params, _ = load_policy(cfg, mesh)
        template = abstract_like(trainer.init_train_state(cfg, model_config, params, mesh))
        state, _ = checkpointer.restore(step, template)
        want, _ = checkpointer.restore(step + 1, template)
    finally:
        checkpointer.close()
    update = trainer.make_family_update(cfg, model_config, mesh)
    batch, _ = trainer.prepare_batch(cfg, load_batch(batch_file), mesh)
    got, _ = update(state, batch, params if cfg.algo.needs_reference else None)
    return compare_trees(got, want)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rljax.replay", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="run directory (holds checkpoints/ and batches/)")
    p.add_argument("--step", required=True, type=int, help="replay the update from checkpoint S to S+1")
    args = p.parse_args(argv)
    verdict = replay(args.workdir, args.step)
    where = f"step {args.step} -> {args.step + 1} in {args.workdir}"
    if verdict.match:
        print(
            f"rljax.replay: MATCH: {where}: all {verdict.leaves} state leaves bitwise identical", flush=True
        )
        return 0
    print(
        f"rljax.replay: MISMATCH: {where}: first differing leaf {verdict.first_mismatch}: {verdict.detail}",
        flush=True,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
