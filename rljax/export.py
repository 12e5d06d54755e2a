"""`python -m rljax.export --workdir W [--step S] --out DIR`: a trained policy as a Hugging Face directory.

Checkpoint S (default: the newest) of a run's workdir becomes DIR: config.json (architectures, `dtype`
float32 unless `--dtype`), model.safetensors, and the tokenizer, chat template and generation_config.json
of the run's base model (`model.path` of the config saved with the checkpoint, or `--model-path`), a
directory that transformers and vLLM load and whose float32 logits are rljax's for the restored params.

The run is left alone, so a run still training can be exported: only finished steps are listed (orbax
renames a step into place once complete), only the params are restored (no optimizer state) onto the
host, and no orbax CheckpointManager is opened there (creating one deletes a save still in flight).
DIR is written as a temporary directory next to it and renamed into place at the end. Exit 0; bad input
(no workdir, no checkpoint, an unknown step, a missing base model, an existing DIR) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rljax.runtime import fail

CHECKPOINTS_DIR = "checkpoints"  # <workdir>/checkpoints (rljax.loop.setup.make_checkpointer)
STATE_ITEM, CONFIG_ITEM = "state", "config"  # item names of rljax.checkpoint.Checkpointer's steps
DTYPES = ("float32", "bfloat16")


def finished_steps(checkpoints: Path) -> list[int]:
    """The steps orbax finished saving in `checkpoints` (in-flight saves carry a tmp suffix; the
    quarantined `corrupt/` steps are not numbers), ascending."""
    return (
        sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []
    )


def choose_step(workdir: str, step: int | None) -> tuple[int, Path]:
    """(step, its directory): `step`, or the newest when None. Exits 2 naming what is missing (the
    workdir, any checkpoint, or the step, listing the available ones)."""
    if not os.path.isdir(workdir):
        fail(f"--workdir: no such directory: {workdir!r}")
    checkpoints = Path(workdir, CHECKPOINTS_DIR)
    steps = finished_steps(checkpoints)
    if not steps:
        fail(f"--workdir: no checkpoint in {checkpoints} (the run saves every checkpoint.every_steps)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        fail(f"--step: no checkpoint step {step} in {checkpoints}; available: {', '.join(map(str, steps))}")
    return step, checkpoints / str(step)


def read_run_config(step_dir: Path) -> Any:
    """The run's `rljax.config.Config`, as saved with the checkpoint."""
    import orbax.checkpoint as ocp

    from rljax import config as config_lib

    saved = ocp.JsonCheckpointHandler().restore(step_dir / CONFIG_ITEM, args=ocp.args.JsonRestore())
    try:
        return config_lib.from_config_dict(dict(saved))
    except config_lib.ConfigError as e:  # saved by another rljax version (a renamed or removed field)
        fail(f"{step_dir / CONFIG_ITEM}: the run's saved config does not parse: {e}")


def base_model_dir(path: str, step: int) -> Path:
    """The run's base checkpoint directory (config.json, tokenizer); a fetchable model's name resolves
    to its cache directory. Exits 2 when it is not a checkpoint directory here."""
    from rljax.models.fetch import FetchError, resolve_model_path

    try:
        resolved = Path(resolve_model_path(path))
    except FetchError as e:  # a fetchable model that is not in the cache and fails to fetch
        fail(f"model.path {path!r}: {e}", code=1)
    if not (resolved / "config.json").is_file():
        fail(
            f"model.path {path!r} (the run's config at step {step}) is not a Hugging Face checkpoint "
            "directory here (relative paths are from the run's working directory); pass --model-path DIR"
        )
    return resolved


def policy_config(cfg: Any, model_dir: Path) -> Any:
    """The run's policy `ModelConfig`: the base checkpoint's config.json with the run's dtypes and decoder."""
    from rljax import models
    from rljax.trainer.state import model_decoder, resolve_model_config

    return resolve_model_config(cfg, models.read_model_config(model_dir, decoder=model_decoder(cfg)))


def restore_params(step_dir: Path, model_config: Any) -> dict:
    """The policy params of a checkpoint step, restored alone (orbax partial restore) onto the host's
    first CPU device, in the dtype they were saved in (`model_config.param_dtype`)."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import SingleDeviceSharding

    from rljax import models

    host = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = {
        "params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host),
            models.abstract_params(model_config),
        )
    }
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return handler.restore(step_dir / STATE_ITEM, args=args)["params"]
    finally:
        handler.close()


def write_generation_config(out: Path, model_config: Any) -> None:
    """generation_config.json from config.json's token ids, when the base model has none to copy."""
    if (out / "generation_config.json").exists():
        return
    hf = model_config.to_hf_dict()
    ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")


def export(
    workdir: str, out: str, *, step: int | None = None, dtype: str = "float32", model_path: str = ""
) -> tuple[int, Path]:
    """Writes checkpoint `step` (default: the newest) of the run in `workdir` to the Hugging Face
    directory `out` in `dtype`; returns (step, out). Exits 2 on bad input (see the module doc)."""
    from rljax.models.hf import check_hf_checkpoint, save_hf_checkpoint

    step, step_dir = choose_step(workdir, step)
    target = Path(out).absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        fail(f"--out {out!r} exists and is not empty; remove it or pick another")
    cfg = read_run_config(step_dir)
    model_dir = base_model_dir(model_path or cfg.model.path, step)
    model_config = policy_config(cfg, model_dir)
    try:
        params = restore_params(step_dir, model_config)
    except ValueError as e:  # orbax: the saved params' tree or shapes are not this model's
        fail(f"checkpoint step {step} does not fit the model in {model_dir}: {str(e).splitlines()[0][:300]}")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        saved = dataclasses.replace(model_config, param_dtype=dtype, compute_dtype=dtype)
        save_hf_checkpoint(saved, params, tmp, tokenizer_dir=model_dir)
        write_generation_config(tmp, saved)
        check_hf_checkpoint(tmp)  # every tensor's name and shape against the written config.json
        os.replace(tmp, target)  # an empty `out` directory is replaced; anything else was refused above
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return step, target


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (see the module doc); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m rljax.export", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="the run's directory (holds checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest)")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write (must not exist)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="tensor dtype of the export")
    p.add_argument(
        "--model-path", default="", help="base checkpoint for config/tokenizer (default: model.path)"
    )
    args = p.parse_args(argv)
    step, out = export(args.workdir, args.out, step=args.step, dtype=args.dtype, model_path=args.model_path)
    print(f"rljax.export: step {step} of {args.workdir} -> {out} ({args.dtype})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
