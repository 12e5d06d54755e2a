"""rljax's weight-transfer engine, running inside each vLLM worker (imported lazily by the plugin).

Registered under every name in `transports.TRANSPORTS` (one class: each `update_info` says whether a
bucket is a file to map, `path`, or bytes to pull from the trainer's bucket server in its `source`, once
per node and from several sources in parallel: `fanout`).
Per update (driven by vLLM's `/start_weight_update`, `/update_weights`, `/finish_weight_update`):

- start: layers whose served tensors are already in checkpoint format (embeddings, lm_heads, norms:
  no quant method, or the unquantized embedding method, same shapes as at load) stay live and are
  loaded straight into the served storage (one copy, no re-allocation, no repacking of the input
  embedding, whose CPU GEMM handle is never used); every other layer (the CPU build's repacked linear
  layers, attention) goes through vLLM's layerwise reload (`initialize_layerwise_reload`'s per-layer
  steps), the path vLLM's own IPC engine and `reload_weights` take. Those layers' parameters move to
  the meta device, so the server must be paused first (a forward pass before finish kills the engine).
  `init_info={"direct_load": false}` sends every layer through layerwise reload (vLLM's own path).
- streamed prefetch: `/update_weights` with `prefetch: true` (sent before `/pause`, right after
  `/start_weight_update`) starts a thread in the worker that receives the listed buckets into its own
  buffers while the server keeps generating, and returns at once; the load call after the pause joins
  it and loads from those buffers. So `start` is lazy: the layers move to the meta device only when the
  first bucket loads.
- each `/update_weights`: one bucket (`path`/`tcp` + `tensors`) or several (`buckets`: a list of such
  dicts, one HTTP round trip for a pre-staged sync). Entries are checked against the served checkpoint's
  names and shapes (an unknown name, a wrong shape or a tensor pushed twice is rejected, naming it,
  before anything of that bucket loads; so are crc32 mismatches when checksums are on), then
  `model.load_weights` on tensors viewing the mapped file or the received buffer. `torch.frombuffer`
  keeps no hold on the mapping, so mappings and buffers stay alive until finish (layerwise reload
  buffers tensors until a layer is complete), unless the bucket asks for `copy`.
- finish: every checkpoint tensor must have arrived (else rejected, naming the first missing one);
  `finalize_layerwise_reload` redoes the backend's processing (the CPU build's GEMM repacking) for the
  layerwise layers; then every `ParallelLMHead` with a `cpu_linear` is repacked
  (`dispatch_cpu_unquantized_gemm`): the head loaded live, and vLLM's CPU build keeps the lm_head's old
  packed copy after any in-place reload when embeddings are tied (PLATFORM.md).
  `init_info={"repack_tied_lm_head": false}` skips that for tied heads (only to show that the canary
  catches the bug).
- on a rejected bucket the update is finalized at once (layers not yet pushed keep their old weights,
  so no parameter stays on the meta device) and the error propagates to the HTTP caller.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import time
import zlib

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from rljax.weight_sync import staging, transports, wire
from rljax.weight_sync.worker import fanout

logger = init_logger("vllm.rljax_shm")  # under "vllm": vLLM configures only that logger tree

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


@dataclasses.dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """What a trainer may choose per server. Checks are not among them: every bucket is checked against
    the served checkpoint, and bucket files come only from the staging root in the server's own
    environment (`RLJAX_STAGING_DIR`), whatever a caller sends."""

    repack_tied_lm_head: bool = True
    direct_load: bool = True  # load checkpoint-format layers straight into the served storage


ABORTED = "weight sync: update session aborted by the trainer"


@dataclasses.dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""
    tensors: list = dataclasses.field(default_factory=list)
    bucket: int = 0
    copy: bool = False
    source: dict | None = None  # a trainer's bucket server (`transports`): pull the bytes from it
    tcp: dict | None = None  # older form of a tcp `source` ({"host", "port", "token", "timeout_s"})
    buckets: list = dataclasses.field(default_factory=list)  # several buckets in one call
    prefetch: bool = False  # streamed only: receive in the background now, load on a later call
    abort: bool = False  # end a session a dead trainer left open (the call fails on purpose, see below)


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads buckets written by `rljax.weight_sync.staging` (mapped or streamed) into the served model."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.options = ShmInitInfo()
        self._keep: list = []  # mappings and receive buffers that loaded tensors view
        self._seen: set[str] = set()
        self._active = False
        self._direct: bool = False
        self._started = False
        self._puller = fanout.Puller(transports.connect)  # streamed buckets: pulled once per node
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
        self._join_prefetch()
        self._seen, self._active, self._started = set(), True, False
        self._slices = wire.SliceAssembler(self.spec())  # sharded staging: blocks -> full tensors
        self._timing = {"map": 0.0, "load": 0.0, "finalize": 0.0, "buckets": 0, "bytes": 0, "start": 0.0}
        self._direct = bool(self.options.direct_load)
        self._puller.reset()

    def _ensure_started(self) -> None:
        """The deferred half of `start`: wait for a prefetch, then take the layers apart for loading."""
        self._join_prefetch()
        if not self._started:
            t0 = time.perf_counter()
            start_reload(self.model, direct=self._direct)
            self._started = True
            self._timing["start"] = time.perf_counter() - t0

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if update_info.abort:
            # vLLM ends a session only through finish (which refuses an incomplete push) or a failing
            # update_weights call (which clears the worker's session flag): the latter is the abort.
            try:
                self._abort()
            finally:
                raise RuntimeError(ABORTED)
        infos = [update_info]
        if update_info.buckets:
            if not all(isinstance(b, dict) for b in update_info.buckets):
                raise ValueError("weight sync: update_info.buckets must be a list of objects")
            infos = [self.parse_update_info(b) for b in update_info.buckets]
        if update_info.prefetch:
            self._start_prefetch(infos)
            return
        try:
            self._ensure_started()
            for info in infos:
                self._receive(info)
        except BaseException:
            self._abort()
            raise

    def _start_prefetch(self, infos: list[ShmUpdateInfo]) -> None:
        if any(_source(i) is None for i in infos):
            raise ValueError("weight sync: prefetch is for streamed buckets only")
        seen: set[str] = set()
        for info in infos:  # names, shapes and sizes before any buffer is allocated
            wire.check_entries(_entries(info), self.spec(), seen)
        self._puller.start([_item(i) for i in infos])

    def _join_prefetch(self) -> None:
        self._puller.join()  # bounded: every receive has the transport's timeout

    def _receive(self, info: ShmUpdateInfo) -> None:
        t0 = time.perf_counter()
        entries = _entries(info)
        wire.check_entries(entries, self.spec(), set(self._seen))  # before any byte is mapped or received
        if _source(info) is not None:
            buf, size = self._fetch(info)
            t0 = time.perf_counter()  # the receive is counted on its own (recv_s)
        else:
            buf, size = self._map(info.path)
        wire.check_entries(entries, self.spec(), self._seen, size)
        weights = [(e.name, self._tensor(buf, e, info.copy)) for e in entries if e.index is None]
        weights += self._assembled(buf, [e for e in entries if e.index is not None])
        if buf is not None:
            if info.copy and isinstance(buf, mmap.mmap):
                buf.close()
            elif not info.copy:
                self._keep.append(buf)  # torch.frombuffer holds no reference: keep alive until finish
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        t1 = time.perf_counter()
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        t = self._timing
        t["map"], t["load"] = t["map"] + t1 - t0, t["load"] + time.perf_counter() - t1
        t["buckets"], t["bytes"] = t["buckets"] + 1, t["bytes"] + sum(e.nbytes for e in entries)

    @staticmethod
    def _map(path: str) -> tuple[mmap.mmap | None, int]:
        root = os.environ.get(staging.STAGING_DIR_ENV) or staging.DEFAULT_STAGING_DIR
        with open(staging.open_bucket(path, root), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # MAP_POPULATE: fault the whole bucket in at once here, not page by page inside vLLM's copies.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return (mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ) if size else None), size

    def _fetch(self, info: ShmUpdateInfo) -> tuple[mmap.mmap | None, int]:
        """Bucket `info` as the node's copy (prefetched, or pulled now: once per node, see `fanout`)."""
        return self._puller.get(_item(info))

    def _assembled(self, buf, entries: list[wire.TensorEntry]) -> list[tuple[str, torch.Tensor]]:
        """Slices (sharded staging) copied into their full tensors; those now complete, to load."""
        out = []
        for e in entries:
            raw = np.frombuffer(_checked_view(buf, e), _UINTS[wire.itemsize(e.dtype)]).reshape(e.shape)
            full = self._slices.add(e.name, e.index, raw)
            if full is not None:
                out.append((e.name, torch.from_numpy(full).view(_TORCH_DTYPES[e.dtype])))
                self._seen.add(e.name)
        return out

    @staticmethod
    def _tensor(buf, e: wire.TensorEntry, copy: bool) -> torch.Tensor:
        if not e.nbytes:
            return torch.empty(e.shape, dtype=_TORCH_DTYPES[e.dtype])
        view = _checked_view(buf, e)
        # A read-only mapping: torch warns that the tensor is not writable; load_weights only reads it.
        t = torch.frombuffer(view, dtype=_TORCH_DTYPES[e.dtype]).view(e.shape)
        return t.clone() if copy else t

    def finish_weight_update(self) -> None:
        try:
            self._join_prefetch()
            optional = frozenset({"lm_head.weight"}) if self._tied else frozenset()
            missing = wire.missing_names(self.spec(), self._seen, optional) + self._slices.incomplete()
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
        self._join_prefetch()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
            if self._tied:  # the tied head shares the embedding's weight but keeps its own packed copy
                if self.options.repack_tied_lm_head:
                    repack_lm_heads(self.model)
            elif self._direct:  # the untied head was loaded live: pack the new weights
                repack_lm_heads(self.model)
        finally:
            self._active = self._started = False
            self._release()
            t = self._timing | {"prefetch": self._puller.prefetch_s, "recv": self._puller.recv_s}
            t["finalize"] = time.perf_counter() - t0
            # One line per update; benchmarks/bench_weight_sync.py parses it from the server log.
            logger.info(
                "rljax-shm update: buckets=%d bytes=%d prefetch_s=%.4f start_s=%.4f map_s=%.4f recv_s=%.4f "
                "load_s=%.4f finalize_s=%.4f direct=%d",
                t["buckets"],
                t["bytes"],
                t.get("prefetch", 0.0),
                t.get("start", 0.0),
                t["map"],
                t["recv"],
                t["load"],
                t["finalize"],
                int(self._direct),
            )

    def _release(self) -> None:
        for m in self._keep:
            if isinstance(m, mmap.mmap):
                try:
                    m.close()
                except BufferError:  # a tensor still views it: leave it to the garbage collector
                    pass
        self._keep = []
        self._puller.release()  # the last worker on the node removes the received files

    def shutdown(self) -> None:
        self._release()


_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # raw element bits: numpy has no bfloat16 or fp8


def _checked_view(buf, e: wire.TensorEntry) -> memoryview:
    """The bytes of entry `e` in `buf`, their crc32 checked when the sender set one."""
    view = memoryview(buf).cast("B")[e.offset : e.offset + e.nbytes]
    if e.crc32 is not None and zlib.crc32(view) != e.crc32:
        raise ValueError(f"weight sync: checksum mismatch for tensor {e.name!r} (bucket bytes corrupted)")
    return view


def _source(info: ShmUpdateInfo) -> dict | None:
    return transports.source_of(info.source, info.tcp)


def _item(info: ShmUpdateInfo) -> tuple[dict, int, int]:
    """`(source, bucket, bytes)`; the size comes from the tensor list, so no sender can choose it."""
    return _source(info), int(info.bucket), wire.bucket_extent(_entries(info))


def _entries(info: ShmUpdateInfo) -> list[wire.TensorEntry]:
    """The bucket's tensor entries; ValueError on a malformed list or a layout `staging` does not write."""
    try:
        entries = [wire.TensorEntry.from_wire(t) for t in info.tensors]
    except (TypeError, ValueError) as e:
        raise ValueError(f"weight sync: malformed tensor list in bucket {info.bucket}: {e}") from e
    wire.bucket_extent(entries)
    return entries


def direct_modules(model: torch.nn.Module) -> set[torch.nn.Module]:
    """Modules whose served tensors are in checkpoint format, so loading can write into them in place:
    with parameters, no buffers, no quant method other than the unquantized embedding one, not
    attention, and every parameter with the shape and dtype it had when the model was loaded."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    out = set()
    for m in model.modules():
        params, buffers = get_layer_params_buffers(m)
        if not params or buffers or is_deferred_attention_layer(m):
            continue
        qm = getattr(m, "quant_method", None)
        if qm is not None and not isinstance(qm, UnquantizedEmbeddingMethod):
            continue
        meta, _ = get_layerwise_info(m).restore_metadata
        named = {k: v for k, v in params.items() if k not in SKIP_TENSORS}
        if (
            named
            and set(named) == set(meta)
            and all(
                tuple(p.shape) == tuple(meta[k].shape) and p.dtype == meta[k].dtype and not p.is_meta
                for k, p in named.items()
            )
        ):
            out.add(m)
    return out


@torch.no_grad()
def start_reload(model: torch.nn.Module, *, direct: bool) -> None:
    """vLLM's `initialize_layerwise_reload`, step for step, for every module but `direct_modules(model)`
    (all of them when `direct` is False), which stay live and take the new weights in place."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        get_layerwise_info,
        initialize_online_processing,
        restore_layer_on_meta,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    keep = direct_modules(model) if direct else set()
    model._original_do_torchao_reload = getattr(model, "_do_torchao_reload", False)
    model._do_torchao_reload = False
    for layer in model.modules():
        if layer in keep:
            continue
        info = get_layerwise_info(layer)
        if info.can_load():
            continue
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        initialize_online_processing(layer)


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
