"""orbax checkpoints with named items, a preservation policy, and fall-back on a bad latest step.

Items of each step:
  state:  the TrainState pytree (params, optimizer state, step, counters) -- sharded arrays.
  extra:  JSON: data-iterator position, policy version, RNG seed, the async rollout buffer, metrics step.
  config: JSON: the resolved config the run was started with.
orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, so a process killed mid-save leaves
nothing `all_steps()` lists; a finished step whose bytes are corrupt fails only at restore, so
`restore_latest` walks back to the newest step that restores, says so on stderr, and moves the newer,
unrestorable steps to `corrupt/` (kept for inspection) so the resumed run can save those steps again.

Test-only hook (fault tests of a save killed in flight): `RLJAX_TEST_SLOW_SAVE_S=<seconds>` makes every async
save (or only step `RLJAX_TEST_SLOW_SAVE_STEP`, when set) wait that long after its data is written and before
orbax renames the step into place, so the step stays `<step>.orbax-checkpoint-tmp*` meanwhile. Unset (the
default) it does nothing; it never changes what is written.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rljax.types import LossInputs

BATCHES_DIR = "batches"
CORRUPT_DIR = "corrupt"  # steps that failed to restore, moved out of orbax's listing


class CheckpointError(RuntimeError):
    """No checkpoint in a non-empty directory could be restored."""


class Checkpointer:
    """One orbax CheckpointManager for a run directory."""

    def __init__(self, directory: str, *, keep_last: int = 3, keep_every: int = 0, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self._saving_step: int | None = None
        slow = _slow_save_hook(lambda: self._saving_step) if async_save else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=slow) if slow else None,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "extra", "config")
        )

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, extra: dict, config: dict, *, force: bool = True) -> bool:
        """Starts saving `step` (asynchronously when configured). Returns whether a save was started."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            extra=ocp.args.JsonSave(extra),
            config=ocp.args.JsonSave(config),
        )
        self._manager.wait_until_finished()  # orbax would too; the slow-save hook reads the step in flight
        self._saving_step = step
        return self._manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores `step` into `abstract_state` (ShapeDtypeStructs carrying the target shardings)."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        return restored["state"], dict(restored["extra"])

    def restore_extra(self, step: int) -> dict:
        return dict(
            self._manager.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]
        )

    def restore_config(self, step: int) -> dict:
        return dict(
            self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        )

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """(step, state, extra) of the newest step that restores; None when there is no checkpoint.

        A step that fails to restore (corrupt or partial) is reported and skipped; if every step fails,
        CheckpointError is raised rather than silently starting from scratch.
        """
        steps = self.all_steps()
        failures = []
        for step in reversed(steps):
            try:
                state, extra = self.restore(step, abstract_state)
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                failures.append(f"step {step}: {type(e).__name__}: {str(e)[:200]}")
                print(
                    f"rljax: checkpoint step {step} in {self.directory} failed to restore "
                    f"({type(e).__name__}); falling back to an earlier step",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            if failures:
                self._quarantine([s for s in steps if s > step])
            return step, state, extra
        if steps:
            raise CheckpointError(
                f"none of the {len(steps)} checkpoints in {self.directory} restores: " + "; ".join(failures)
            )
        return None

    def _quarantine(self, bad_steps: list[int]) -> None:
        """Moves steps that failed to restore to `<directory>/corrupt/<step>-<time>` (kept for inspection,
        never listed again), so that the resumed run can save those step numbers afresh."""
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            os.makedirs(os.path.join(self.directory, CORRUPT_DIR), exist_ok=True)
            for step in bad_steps:
                target = os.path.join(self.directory, CORRUPT_DIR, f"{step}-{stamp}")
                os.replace(os.path.join(self.directory, str(step)), target)
                print(f"rljax: moved unrestorable checkpoint step {step} to {target}", file=sys.stderr)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("rljax_checkpoint_quarantine")
        self._manager.reload()

    def reached_preemption(self, step: int) -> bool:
        """True on every process once a preemption notice (SIGTERM via jax.distributed) reached `step`."""
        return self._manager.reached_preemption(step)

    def wait(self) -> None:
        """Blocks until an in-flight async save has finished (and been renamed into place)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _slow_save_hook(saving_step):
    """The RLJAX_TEST_SLOW_SAVE_S callback (run by orbax before the final rename), or None when unset."""
    seconds = float(os.environ.get("RLJAX_TEST_SLOW_SAVE_S") or 0)
    only = os.environ.get("RLJAX_TEST_SLOW_SAVE_STEP")
    if seconds <= 0:
        return None

    def hold() -> None:
        if only is None or int(only) == saving_step():
            print(f"rljax: test hook: holding save of step {saving_step()} for {seconds} s", file=sys.stderr)
            time.sleep(seconds)

    return hold


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete array tree: the restore target for the same layout."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


def batch_path(workdir: str, step: int) -> str:
    """Where the batch trained on from checkpoint `step` (producing `step + 1`) is saved."""
    return os.path.join(workdir, BATCHES_DIR, f"step_{step:08d}.npz")


def save_batch(workdir: str, step: int, batch: LossInputs) -> str:
    """Writes a host LossInputs to `batch_path(workdir, step)` atomically (a killed write leaves no file)."""
    path = batch_path(workdir, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    arrays = {f.name: np.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load_batch(path: str) -> LossInputs:
    """The LossInputs `save_batch` wrote (bit for bit, sampler settings included)."""
    with np.load(path) as data:
        fields = {f.name: data[f.name] for f in dataclasses.fields(LossInputs)}
    for name in ("temperature", "top_p"):
        fields[name] = float(fields[name])
    fields["top_k"] = int(fields["top_k"])
    return LossInputs(**fields)
