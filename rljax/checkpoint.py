"""orbax checkpoints with named items, a preservation policy, and fall-back on a bad latest step.

Items of each step:
  state:  the TrainState pytree (params, optimizer state, step, counters) -- sharded arrays.
  extra:  JSON: data-iterator position, policy version, RNG seed, the async rollout buffer, metrics step.
  config: JSON: the resolved config the run was started with.
orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, so a process killed mid-save leaves
nothing `all_steps()` lists; a finished step whose bytes are corrupt fails only at restore, so
`restore_latest` walks back to the newest step that restores, says so on stderr, and moves the newer,
corrupt steps to `corrupt/` (kept for inspection) so the resumed run can save those steps again.
Only recognised corruption (the saved bytes fail to read or decode: `classify_restore_error`) is
quarantined. A step that does not fit the run's state (a changed model or optimizer config) raises
`CheckpointMismatchError`; any other failure (an I/O or permission error) raises `CheckpointError` and
moves nothing. In a multi-process run every process tries each step, then all agree on the worst outcome
(`agree`, an allgather) before anyone quarantines or restores, so all resume from the same step.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import pathlib
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
    """No checkpoint in a non-empty directory could be restored, or a step failed for a reason other than
    recognised corruption (nothing was moved)."""


class CheckpointMismatchError(CheckpointError):
    """The newest checkpoint does not fit this run's state (saved with another model/optimizer config)."""


class RestoreOutcome(enum.IntEnum):
    """One process's result of restoring one step, ordered so that the worst across processes wins."""

    OK = 0
    CORRUPT = 1  # the saved bytes fail to read or decode: skipped, quarantined once an older step restores
    FAILED = 2  # anything else (an I/O or permission error, ...): the run stops, nothing is moved
    MISMATCH = 3  # the step's tree or shapes differ from this run's state: the run stops, nothing is moved


# tensorstore's status prefixes for damaged bytes: checksum/decode failures, truncated files, files missing
# from a step orbax had committed (orbax only lists steps whose save finished).
_CORRUPT_STATUSES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND")
# orbax's messages for a restore target whose shapes or tree structure differ from the saved ones.
_MISMATCH_TEXTS = ("is not compatible with the stored shape", "tree structures do not match")


def classify_restore_error(error: BaseException) -> RestoreOutcome:
    """CORRUPT, MISMATCH or FAILED for an exception raised while restoring a step (never OK).

    Unrecognised errors are FAILED: quarantining is reserved for recognised corruption."""
    text = str(error)
    if isinstance(error, ValueError) and any(t in text for t in _MISMATCH_TEXTS):
        return RestoreOutcome.MISMATCH
    if isinstance(error, json.JSONDecodeError | UnicodeDecodeError | FileNotFoundError):
        return RestoreOutcome.CORRUPT
    if isinstance(error, ValueError) and text.split(":", 1)[0].strip() in _CORRUPT_STATUSES:
        return RestoreOutcome.CORRUPT
    return RestoreOutcome.FAILED


def agree(outcomes) -> RestoreOutcome:
    """The outcome every process acts on: the worst of all processes' outcomes for the same step."""
    return RestoreOutcome(max(int(o) for o in outcomes))


def agree_across_processes(outcome: RestoreOutcome) -> RestoreOutcome:
    """`agree` over all processes of the job (an allgather); the local outcome in a one-process run."""
    if jax.process_count() == 1:
        return outcome
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(int(outcome), np.int32))
    return agree(np.asarray(gathered).reshape(-1).tolist())


def manager_options(*, keep_last: int, keep_every: int, async_save: bool) -> ocp.CheckpointManagerOptions:
    """A `Checkpointer`'s orbax options: keep the last `keep_last` steps and every `keep_every`-th."""
    return ocp.CheckpointManagerOptions(
        max_to_keep=keep_last,
        keep_period=keep_every or None,
        enable_async_checkpointing=async_save,
        create=True,
        cleanup_tmp_directories=True,
    )


class Checkpointer:
    """One orbax CheckpointManager for a run directory."""

    def __init__(self, directory: str, *, keep_last: int = 3, keep_every: int = 0, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = manager_options(keep_last=keep_last, keep_every=keep_every, async_save=async_save)
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

    def restore_extra(self, step: int) -> dict:
        return dict(
            self._manager.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]
        )

    def restore_config(self, step: int) -> dict:
        return dict(
            self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        )

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """(step, state, extra) of the newest step that restores on every process; None when there is no
        checkpoint.

        A step that is corrupt on any process is reported and skipped; the skipped steps are moved to
        `corrupt/` once an older one restores. CheckpointMismatchError when the newest readable step does
        not fit `abstract_state`; CheckpointError when a step fails otherwise (nothing moved) or when
        every step is corrupt (rather than silently starting from scratch).
        """
        steps = self.all_steps()
        corrupt, failures = [], []
        for step in reversed(steps):
            local, restored, error = self._try_restore(step, abstract_state)
            outcome = agree_across_processes(local)
            if outcome is RestoreOutcome.OK:
                if corrupt:
                    self._quarantine(corrupt)
                return step, *restored
            detail = _describe(error) if error is not None else "another process failed to restore it"
            where = f"checkpoint step {step} in {self.directory}"
            if outcome is RestoreOutcome.MISMATCH:
                raise CheckpointMismatchError(
                    f"{where} does not fit this run's state ({detail}); resume with the config it was "
                    f"saved with ({os.path.join(self.directory, str(step), 'config')}) or use a new workdir"
                )
            if outcome is RestoreOutcome.FAILED:
                raise CheckpointError(
                    f"{where} failed to restore and is not recognisably corrupt ({detail}); nothing was "
                    "moved: rerun once the storage reads again"
                )
            corrupt.append(step)
            failures.append(f"step {step}: {detail}")
            print(f"rljax: {where} is corrupt ({detail}); falling back to an earlier step", file=sys.stderr)
        if steps:
            raise CheckpointError(
                f"none of the {len(steps)} checkpoints in {self.directory} restores: " + "; ".join(failures)
            )
        return None

    def _try_restore(self, step: int, abstract_state: Any) -> tuple[RestoreOutcome, tuple | None, Any]:
        """(outcome, (state, extra) or None, the exception or None) of restoring `step` on this process.

        Reads through the item handlers, not the manager: the manager's restore ends in a barrier that a
        process whose read failed would never reach, so processes could not agree afterwards."""
        step_dir = pathlib.Path(self.directory, str(step))
        handler = ocp.StandardCheckpointHandler()
        try:
            state = handler.restore(step_dir / "state", args=ocp.args.StandardRestore(abstract_state))
            extra = ocp.JsonCheckpointHandler().restore(step_dir / "extra", args=ocp.args.JsonRestore())
        except Exception as e:  # orbax/tensorstore raise many types; classify_restore_error sorts them
            return classify_restore_error(e), None, e
        finally:
            handler.close()
        return RestoreOutcome.OK, (state, dict(extra)), None

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


def _describe(error: BaseException) -> str:
    """`Type: first line of the message` (tensorstore appends a long spec to its messages)."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete array tree: the restore target for the same layout."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


# Entries of a checkpoint's saved config that are not `rljax.config.Config` fields: what a LoRA run records
# of its frozen base (`base_identity`).
RUN_RECORDS = ("lora_base",)


def saved_run_config(saved: dict) -> tuple[dict, dict]:
    """(the `Config` dict, the run records) of a checkpoint's saved config (`Checkpointer.restore_config`)."""
    saved = dict(saved)
    return saved, {k: saved.pop(k) for k in RUN_RECORDS if k in saved}


IDENTITY_SAMPLES, IDENTITY_SAMPLE_BYTES = 64, 4096  # weight bytes a base's identity reads per file


def base_identity(path: str) -> dict:
    """What a LoRA checkpoint records of its frozen base model instead of its bytes: the path and a
    sha256 over `config.json` and every `*.safetensors` file's name, size, header (tensor names, dtypes,
    shapes and offsets) and 64 evenly spaced 4 KiB samples of its weights: ~256 KiB read per file, cheap
    for a 15 GB model, and it tells apart two models of one architecture (base vs instruct, another seed),
    whose configs and headers can be identical."""
    digest = hashlib.sha256()
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors") or n == "config.json")
    for name in names:
        file = os.path.join(path, name)
        total = os.path.getsize(file)
        digest.update(f"{name}:{total}:".encode())
        with open(file, "rb") as f:
            if name == "config.json":
                digest.update(f.read())
                continue
            size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(size, 100 * 2**20)))  # the JSON header (bounded)
            start = 8 + size
            span = max(total - start - IDENTITY_SAMPLE_BYTES, 0)
            for i in range(IDENTITY_SAMPLES):
                f.seek(start + span * i // max(IDENTITY_SAMPLES - 1, 1))
                digest.update(f.read(IDENTITY_SAMPLE_BYTES))
    return {"path": os.path.abspath(path), "fingerprint": digest.hexdigest()}


def batch_path(workdir: str, step: int) -> str:
    """Where the batch trained on from checkpoint `step` (producing `step + 1`) is saved."""
    return os.path.join(workdir, BATCHES_DIR, f"step_{step:08d}.npz")


def save_batch(workdir: str, step: int, batch: LossInputs) -> str:
    """Writes a host LossInputs to `batch_path(workdir, step)` atomically (a killed write leaves no file)."""
    path = batch_path(workdir, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    arrays = {name: np.asarray(v) for name, v in values.items() if v is not None}  # None: a default
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load_batch(path: str) -> LossInputs:
    """The LossInputs `save_batch` wrote (bit for bit, sampler settings included)."""
    with np.load(path) as data:
        fields = {f.name: data[f.name] for f in dataclasses.fields(LossInputs) if f.name in data.files}
    for name in ("temperature", "top_p"):
        fields[name] = float(fields[name])
    fields["top_k"] = int(fields["top_k"])
    return LossInputs(**fields)
