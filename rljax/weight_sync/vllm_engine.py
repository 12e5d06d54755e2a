"""rljax's "shm" weight-transfer engine, running inside each vLLM worker (imported lazily by the plugin).

Per update (driven by vLLM's `/start_weight_update`, `/update_weights`, `/finish_weight_update`):

- start: `initialize_layerwise_reload(model)`, the path vLLM's own IPC engine takes. It moves layer
  parameters to the meta device, so the server must be paused first (a forward pass before finish
  kills the engine).
- each bucket: the entries are checked against the served checkpoint's names and shapes (an unknown
  name, a wrong shape or a tensor pushed twice is rejected, naming it, before anything of that bucket
  loads; so are crc32 mismatches when checksums are on), then `model.load_weights` on tensors viewing
  the mapped file. `torch.frombuffer` keeps no hold on the mapping, so mappings stay open until finish
  (layerwise reload buffers tensors until a layer is complete), unless the bucket asks for `copy`.
- finish: every checkpoint tensor must have arrived (else rejected, naming the first missing one);
  `finalize_layerwise_reload` redoes the backend's processing (the CPU build's GEMM repacking), then
  the tied-lm_head fix: vLLM's CPU build keeps the lm_head's old packed copy after any in-place reload
  when embeddings are tied (PLATFORM.md), so for tied models `dispatch_cpu_unquantized_gemm` re-runs on every
  `ParallelLMHead` that has `cpu_linear`. `init_info={"repack_tied_lm_head": false}` turns the fix off
  (only to show that the canary catches the bug).
- on a rejected bucket the update is finalized at once (layers not yet pushed keep their old weights,
  so no parameter stays on the meta device) and the error propagates to the HTTP caller.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import time
import zlib

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from rljax.weight_sync import wire

logger = init_logger("vllm.rljax_shm")  # under "vllm": vLLM configures only that logger tree

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class ShmInitInfo(WeightTransferInitInfo):
    repack_tied_lm_head: bool = True
    validate: bool = True  # check names/shapes against the served checkpoint


@dataclasses.dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    path: str
    tensors: list
    bucket: int = 0
    copy: bool = False


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads bucket files written by `rljax.weight_sync.staging` into the served model."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.options = ShmInitInfo()
        self._maps: list[mmap.mmap] = []
        self._seen: set[str] = set()
        self._active = False
        self._spec: dict | None = None
        self._timing: dict = {}
        self._tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.options = init_info

    def spec(self) -> dict:
        """`{hf_name: (shape, dtype)}` of the checkpoint this server loaded (read once, headers only)."""
        if self._spec is None:
            self._spec = wire.read_checkpoint_spec(self.model_config.model)
        return self._spec

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._seen, self._active = set(), True
        self._timing = {"map": 0.0, "load": 0.0, "finalize": 0.0, "buckets": 0, "bytes": 0}
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        try:
            self._receive(update_info)
        except BaseException:
            self._abort()
            raise

    def _receive(self, info: ShmUpdateInfo) -> None:
        t0 = time.perf_counter()
        entries = [wire.TensorEntry.from_wire(t) for t in info.tensors]
        with open(info.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if self.options.validate:
                wire.check_entries(entries, self.spec(), self._seen, size)
            # MAP_POPULATE: fault the whole bucket in at once here, not page by page inside vLLM's copies.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ) if size else None
        weights = [(e.name, self._tensor(mapping, e, info.copy)) for e in entries]
        if mapping is not None:
            if info.copy:
                mapping.close()
            else:
                self._maps.append(mapping)  # torch.frombuffer holds no reference: keep alive until finish
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        t1 = time.perf_counter()
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        t = self._timing
        t["map"], t["load"] = t["map"] + t1 - t0, t["load"] + time.perf_counter() - t1
        t["buckets"], t["bytes"] = t["buckets"] + 1, t["bytes"] + sum(e.nbytes for e in entries)

    @staticmethod
    def _tensor(mapping: mmap.mmap, e: wire.TensorEntry, copy: bool) -> torch.Tensor:
        view = memoryview(mapping)[e.offset : e.offset + e.nbytes]
        if e.crc32 is not None and zlib.crc32(view) != e.crc32:
            raise ValueError(f"weight sync: checksum mismatch for tensor {e.name!r} (bucket bytes corrupted)")
        # A read-only mapping: torch warns that the tensor is not writable; load_weights only reads it.
        t = (
            torch.frombuffer(view, dtype=_TORCH_DTYPES[e.dtype]).view(e.shape)
            if e.nbytes
            else (torch.empty(e.shape, dtype=_TORCH_DTYPES[e.dtype]))
        )
        return t.clone() if copy else t

    def finish_weight_update(self) -> None:
        try:
            if self.options.validate:
                optional = frozenset({"lm_head.weight"}) if self._tied else frozenset()
                missing = wire.missing_names(self.spec(), self._seen, optional)
                if missing:
                    raise ValueError(
                        f"weight sync: tensor {missing[0]!r} was not pushed ({len(missing)} missing)"
                    )
        finally:
            self._finalize()

    def _abort(self) -> None:
        if self._active:
            self._finalize()

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
            if self._tied and self.options.repack_tied_lm_head:  # untied heads are processed like any layer
                repack_lm_heads(self.model)
        finally:
            self._active = False
            self._release()
            t = self._timing
            t["finalize"] = time.perf_counter() - t0
            # One line per update; benchmarks/bench_weight_sync.py parses it from the server log.
            logger.info(
                "rljax-shm update: buckets=%d bytes=%d map_s=%.4f load_s=%.4f finalize_s=%.4f",
                t["buckets"],
                t["bytes"],
                t["map"],
                t["load"],
                t["finalize"],
            )

    def _release(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor still views it: leave it to the garbage collector
                pass
        self._maps = []

    def shutdown(self) -> None:
        self._release()


def repack_lm_heads(model: torch.nn.Module) -> int:
    """Re-runs the CPU GEMM dispatch on every `ParallelLMHead` with a `cpu_linear` (the tied-head fix).
    Returns how many heads were repacked (0 on non-CPU backends)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    count = 0
    for m in model.modules():
        if isinstance(m, ParallelLMHead) and hasattr(m, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(m, remove_weight=False)
            count += 1
    return count
