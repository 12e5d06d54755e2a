"""LoRA sync: each policy version is a new adapter, loaded through vLLM's own runtime-LoRA mechanism.

    publisher = AdapterPublisher(urls, root, base_model, canary=spec, gate=gate, headers=...)
    metrics = publisher.publish(tensors, peft_config, version, logprobs=trainer_logprobs)
    with publisher.lease() as (name, version):   # generate with model=name; samples carry `version`
        ...
    publisher.close()

Only the adapter moves (PEFT's names and layouts: `...q_proj.lora_A.weight` f32[r, in], `lora_B.weight`
f32[out, r], `adapter_config.json`), so a push is megabytes where a full push is the whole model. A version
is never visible before it is complete: its directory is written under a temporary name, synced and renamed
(`write_adapter`); every server loads it (`POST /v1/load_lora_adapter`, vLLM reads and validates it there);
the canary then asks each server for log-probs *under the new adapter's name* while generation still uses the
previous one; only then does the new name become current. A failed load or canary unloads the new name from
every server and raises: the previous version keeps serving.

The previous version is retired (`POST /v1/unload_lora_adapter`, its directory removed) only when no request
that was sampled with it is still in flight: requests hold a lease (`lease()`) for the adapter they were sent
with, so a push during generation never pulls an adapter from under its requests (the peers' bugs: an adapter
read before it was fully written, or deleted while a request still used it). vLLM's servers need
`--enable-lora --max-lora-rank R --max-loras 2` (the current and the retiring version) and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`lora_server_args`). The adapter directory must be readable by every
server at the same path (one host, or a shared filesystem). Trainer room: no torch, no vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import requests
from safetensors.numpy import save_file

from rljax.weight_sync.canary import CanaryError, CanarySpec, TrainerLogprobs, check_canary
from rljax.weight_sync.gate import PolicyGate

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
NAME_PREFIX = "rljax-lora-v"
TMP_PREFIX = ".partial-"
# vLLM accepts only these maximum ranks (vllm.config.lora: possible_max_ranks).
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterSyncError(RuntimeError):
    """A server refused or failed to load (or unload) an adapter version."""


def adapter_name(version: int, run: str) -> str:
    """The name under which policy `version`'s adapter is served (the requests' `model`). `run` (random per
    publisher) keeps names unique across runs and restarts: vLLM keys its prefix cache by the adapter's
    name, so a resumed run's version 11 under a bare `v11` would reuse KV blocks an earlier run computed
    under its own version 11 (the canary's first-token probe caught exactly that)."""
    return f"{NAME_PREFIX}{int(version)}-{run}"


def lora_server_args(rank: int, max_loras: int = 2) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(vLLM arguments, environment) of a server that loads rljax's adapters at run time: the smallest
    rank vLLM accepts that holds `rank`; `max_loras` adapters in one batch (the current and the retiring)."""
    max_rank = next((r for r in VLLM_MAX_RANKS if r >= rank), None)
    if max_rank is None:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_MAX_RANKS[-1]})")
    args = ("--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", str(max_loras))
    return args, (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_adapter(root: Path, version: int, tensors: Mapping[str, np.ndarray], config: Mapping) -> Path:
    """Writes a PEFT adapter directory `root/v<version>` atomically: files written and synced under a
    temporary name, then one rename (a reader sees the whole adapter or no directory). Returns its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{int(version)}"
    tmp = root / f"{TMP_PREFIX}v{int(version)}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / ADAPTER_FILE))
    (tmp / CONFIG_FILE).write_text(json.dumps(dict(config), indent=1, sort_keys=True))
    for f in (tmp / ADAPTER_FILE, tmp / CONFIG_FILE, tmp):
        _fsync(f)
    if final.exists():  # a re-push of the same version (recovery): replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    return final


def clear_partial(root: Path) -> int:
    """Removes what a crash mid-write left (temporary directories); returns how many."""
    root = Path(root)
    partial = list(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return len(partial)


def _post(url: str, route: str, body: dict, headers: dict | None, timeout_s: float) -> requests.Response:
    return requests.post(f"{url}{route}", json=body, headers=headers or {}, timeout=timeout_s)


class AdapterPublisher:
    """Loads adapter versions into every server and hands requests the current one (see the module doc).

    `base_model`: the served base model's name, current before the first push (version 0: no adapter).
    """

    def __init__(
        self,
        urls: Sequence[str],
        root: Path,
        base_model: str,
        *,
        canary: CanarySpec | None = None,
        gate: PolicyGate | None = None,
        headers: dict | None = None,
        timeout_s: float = 60.0,
        canary_tolerance: float = 1e-3,
    ):
        self.urls, self.root, self.headers = list(urls), Path(root), headers
        self.canary, self.gate = canary, gate or PolicyGate()
        self.timeout_s, self.canary_tolerance = timeout_s, canary_tolerance
        self.run = secrets.token_hex(4)
        self._current: tuple[str, int] = (base_model, self.gate.version)
        self._paths: dict[str, Path] = {}
        self._inflight: dict[str, int] = {}
        self._retiring: set[str] = set()
        self._lock = threading.Lock()
        clear_partial(self.root)

    @property
    def current(self) -> tuple[str, int]:
        """(served name, policy version) that new requests use."""
        return self._current

    @contextlib.contextmanager
    def lease(self) -> Iterator[tuple[str, int]]:
        """The current (name, version), held until the block ends: its adapter stays loaded meanwhile.
        Holds the gate shared too, so a recovery's restart (which breaks the gate) is seen by the caller."""
        with self.gate.shared(), self._lock:
            name, version = self._current
            self._inflight[name] = self._inflight.get(name, 0) + 1
        try:
            yield name, version
        finally:
            with self._lock:
                self._inflight[name] -= 1
                done = name in self._retiring and self._inflight[name] == 0
            if done:
                self._retire(name)

    def in_flight(self, name: str) -> int:
        with self._lock:
            return self._inflight.get(name, 0)

    def loaded(self) -> list[str]:
        """Adapter names still loaded (current and retiring), oldest first."""
        with self._lock:
            return list(self._paths)

    def publish(
        self,
        tensors: Mapping[str, np.ndarray],
        config: Mapping,
        version: int,
        *,
        logprobs: TrainerLogprobs | None = None,
    ) -> dict[str, float]:
        """Writes, loads on every server, checks (the canary, answered by `logprobs`) and switches to
        `version`'s adapter; retires the previous version once its requests are done. Pushing the current
        version again (a recovery's re-push) loads it where it is missing and checks it. Raises
        AdapterSyncError or CanaryError (nothing switched)."""
        t0 = time.perf_counter()
        name = adapter_name(version, self.run)
        repush = name == self._current[0]
        path = self._paths[name] if repush else write_adapter(self.root, version, tensors, config)
        t_write = time.perf_counter()
        with self._lock:
            self._paths[name] = path
        try:
            for url in self.urls:
                self._load(url, name, path)
            t_load = time.perf_counter()
            check = self.canary is not None and logprobs is not None
            diffs = [self._check(url, name, logprobs) for url in self.urls] if check else []
        except BaseException:
            if not repush:
                self._retire(name)
            raise
        self._switch(name, int(version))
        metrics = {
            "weight_sync/bytes": float(sum(np.asarray(v).nbytes for v in tensors.values())),
            "weight_sync/stage_seconds": t_write - t0,  # the adapter directory written
            "weight_sync/engine_seconds": t_load - t_write,  # every server loaded it
            "weight_sync/pause_seconds": 0.0,  # generation never pauses: the previous adapter serves
            "weight_sync/seconds": time.perf_counter() - t0,
        }
        if diffs:
            metrics["weight_sync/canary_logprob_max_abs_diff"] = max(d[0] for d in diffs)
            metrics["weight_sync/canary_logprob_mean_abs_diff"] = float(np.mean([d[1] for d in diffs]))
        return metrics

    def _switch(self, name: str, version: int) -> None:
        """`name` becomes current (the gate's version and servable again); the previous one retires when
        idle."""
        with self._lock:
            previous = self._current[0]
            self._current = (name, version)
            if previous != name and previous in self._paths:
                self._retiring.add(previous)
            idle = previous in self._retiring and self._inflight.get(previous, 0) == 0
        self.gate.version, self.gate.broken = version, None
        if idle:
            self._retire(previous)

    def server_version(self, url: str) -> str:
        """The policy version `url` serves: the current version when its adapter (or, at version 0, the
        base model) is listed by the server, else ""."""
        name, version = self._current
        resp = requests.get(f"{url}/v1/models", headers=self.headers or {}, timeout=self.timeout_s)
        listed = resp.status_code == 200 and any(m.get("id") == name for m in resp.json().get("data", []))
        return str(version) if listed else ""

    def reset(self) -> None:
        """Nothing per server to forget (a restarted server gets the current adapter by the re-push)."""

    def _load(self, url: str, name: str, path: Path) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        resp = _post(url, "/v1/load_lora_adapter", body, self.headers, self.timeout_s)
        if resp.status_code == 400 and "already been loaded" in resp.text:
            return  # a re-push of a version this server has (recovery restarted another one)
        if resp.status_code != 200:
            raise AdapterSyncError(
                f"{url} did not load adapter {name} from {path}: HTTP {resp.status_code} {resp.text[:300]}"
            )

    def _check(self, url: str, name: str, logprobs: TrainerLogprobs) -> tuple[float, float]:
        try:
            return check_canary(
                url, name, self.canary, logprobs, tolerance=self.canary_tolerance,
                timeout_s=self.timeout_s, headers=self.headers,
            )  # fmt: skip
        except CanaryError as e:
            raise CanaryError(f"adapter {name}: {e}") from e

    def _retire(self, name: str) -> None:
        """Unloads `name` from every server (best effort: a dead server has nothing loaded) and removes
        its directory."""
        for url in self.urls:
            with contextlib.suppress(requests.RequestException):
                _post(url, "/v1/unload_lora_adapter", {"lora_name": name}, self.headers, self.timeout_s)
        with self._lock:
            path = self._paths.pop(name, None)
            self._retiring.discard(name)
            self._inflight.pop(name, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Retires every loaded adapter (in-flight requests are the caller's to have finished)."""
        for name in self.loaded():
            self._retire(name)
