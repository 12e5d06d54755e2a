"""orbax checkpoints with named items, a preservation policy, and fall-back on a bad latest step.

Items of each step:
  state:  the TrainState pytree (params, optimizer state, step, counters) -- sharded arrays.
  extra:  JSON: data-iterator position, policy version, RNG seed, the async rollout buffer, metrics step.
  config: JSON: the resolved config the run was started with.
orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, so a process killed mid-save leaves
nothing `all_steps()` lists; a finished step whose bytes are corrupt fails only at restore, so
`restore_latest` walks back to the newest step that restores and says so on stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """No checkpoint in a non-empty directory could be restored."""


class Checkpointer:
    """One orbax CheckpointManager for a run directory."""

    def __init__(self, directory: str, *, keep_last: int = 3, keep_every: int = 0, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
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
        return self._manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores `step` into `abstract_state` (ShapeDtypeStructs carrying the target shardings)."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        return restored["state"], dict(restored["extra"])

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
            return step, state, extra
        if steps:
            raise CheckpointError(
                f"none of the {len(steps)} checkpoints in {self.directory} restores: " + "; ".join(failures)
            )
        return None

    def reached_preemption(self, step: int) -> bool:
        """True on every process once a preemption notice (SIGTERM via jax.distributed) reached `step`."""
        return self._manager.reached_preemption(step)

    def wait(self) -> None:
        """Blocks until an in-flight async save has finished (and been renamed into place)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete array tree: the restore target for the same layout."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )
