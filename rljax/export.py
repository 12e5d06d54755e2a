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

A LoRA run (`model.lora_rank > 0`, docs/lora.md) checkpoints the adapter only. `--merge` (its default)
writes the merged model (`W + (alpha / r) B A` folded into the base's weights: a plain Hugging Face
directory); `--adapter` writes the PEFT adapter instead (`adapter_model.safetensors`, `adapter_config.json`
naming the base, and the base's tokenizer files), which `peft.PeftModel.from_pretrained` and vLLM's
`enable_lora` load over the base model. Either way the base must be the one the adapter was trained on (its
identity is saved with the checkpoint; another base exits 2).
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

from rljax.checkpoint import saved_run_config
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


def read_saved(step_dir: Path) -> tuple[Any, dict]:
    """(the run's `rljax.config.Config`, its run records such as a LoRA base's identity), as saved with
    the checkpoint."""
    import orbax.checkpoint as ocp

    from rljax import config as config_lib

    saved = ocp.JsonCheckpointHandler().restore(step_dir / CONFIG_ITEM, args=ocp.args.JsonRestore())
    config_dict, records = saved_run_config(saved)
    try:
        return config_lib.from_config_dict(config_dict), records
    except config_lib.ConfigError as e:  # saved by another rljax version (a renamed or removed field)
        fail(f"{step_dir / CONFIG_ITEM}: the run's saved config does not parse: {e}")


def read_run_config(step_dir: Path) -> Any:
    """The run's `rljax.config.Config`, as saved with the checkpoint."""
    return read_saved(step_dir)[0]


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
    """The trained params of a checkpoint step (the policy's, or a LoRA run's adapter), restored alone
    (orbax partial restore) onto the host's first CPU device, in the dtype they were saved in."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import SingleDeviceSharding

    from rljax.trainer.state import abstract_trainable

    host = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = {
        "params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), abstract_trainable(model_config)
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


def check_lora_base(records: dict, model_dir: Path, step: int) -> None:
    """Exits 2 unless `model_dir` is the base model the LoRA checkpoint's adapter was trained on."""
    from rljax.checkpoint import base_identity

    saved = records.get("lora_base")
    if saved is not None and base_identity(str(model_dir))["fingerprint"] != saved["fingerprint"]:
        fail(
            f"--model-path {str(model_dir)!r} is not the base model checkpoint step {step}'s LoRA adapter "
            f"was trained on ({saved['path']}); pass that model's directory"
        )


def write_peft_adapter(out: Path, model_config: Any, adapter: dict, model_dir: Path, dtype: str) -> None:
    """`out` as a PEFT adapter directory over the base model `model_dir` (see the module doc)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from rljax.models import lora
    from rljax.models.hf import copy_tokenizer

    out.mkdir(parents=True)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {k: v.astype(np_dtype) for k, v in lora.peft_tensors(model_config, adapter).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = lora.peft_config(model_config, str(model_dir))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(model_dir, out)  # the base's tokenizer and chat template, as PEFT adapters ship them


def write_model(out: Path, model_config: Any, params: dict, model_dir: Path, dtype: str) -> None:
    """`out` as a Hugging Face model directory in `dtype`; a LoRA run's adapter is merged into its base."""
    from rljax import models
    from rljax.models import lora
    from rljax.models.hf import check_hf_checkpoint, save_hf_checkpoint

    if model_config.lora_rank:
        base = models.load_hf_checkpoint(model_dir, dtype="float32")[1]
        params = lora.merged_params(model_config, base, params)
        model_config = lora.base_config(model_config)
    saved = dataclasses.replace(model_config, param_dtype=dtype, compute_dtype=dtype)
    save_hf_checkpoint(saved, params, out, tokenizer_dir=model_dir)
    write_generation_config(out, saved)
    check_hf_checkpoint(out)  # every tensor's name and shape against the written config.json


def export(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str = "float32",
    model_path: str = "",
    adapter: bool = False,
) -> tuple[int, Path]:
    """Writes checkpoint `step` (default: the newest) of the run in `workdir` to the Hugging Face
    directory `out` in `dtype` (`adapter`: a LoRA run's PEFT adapter instead of the merged model);
    returns (step, out). Exits 2 on bad input (see the module doc)."""
    step, step_dir = choose_step(workdir, step)
    target = Path(out).absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        fail(f"--out {out!r} exists and is not empty; remove it or pick another")
    cfg, records = read_saved(step_dir)
    model_dir = base_model_dir(model_path or cfg.model.path, step)
    model_config = policy_config(cfg, model_dir)
    if adapter and not model_config.lora_rank:
        fail(f"--adapter: checkpoint step {step} is a full fine-tuning run (model.lora_rank 0): no adapter")
    check_lora_base(records, model_dir, step)
    try:
        params = restore_params(step_dir, model_config)
    except ValueError as e:  # orbax: the saved params' tree or shapes are not this model's
        fail(f"checkpoint step {step} does not fit the model in {model_dir}: {str(e).splitlines()[0][:300]}")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write = write_peft_adapter if adapter else write_model
        write(tmp, model_config, params, model_dir, dtype)
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
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--merge", action="store_true", help="LoRA run: the merged model (the default)")
    kind.add_argument("--adapter", action="store_true", help="LoRA run: the PEFT adapter over its base")
    args = p.parse_args(argv)
    step, out = export(
        args.workdir,
        args.out,
        step=args.step,
        dtype=args.dtype,
        model_path=args.model_path,
        adapter=args.adapter,
    )
    what = "PEFT adapter" if args.adapter else args.dtype
    print(f"rljax.export: step {step} of {args.workdir} -> {out} ({what})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
