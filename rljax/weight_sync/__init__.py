"""Host-staged, verified weight sync from the trainer into running vLLM servers (see `syncer`).

Two rooms: this package's modules run in the trainer's process (stage, pause, load through vLLM's RL
endpoints, verify, resume; the transports' bucket servers); `worker/` runs inside vLLM's processes (the
plugin, the weight-transfer engine, the per-node fan-out) and is the only code importing torch or vLLM.
Both read the shared wire format (`wire`, `staging`), `transports` and `idle_spin`; neither imports the
other's room.
"""

import importlib

# name -> the module defining it; resolved on first use (PEP 562), so that vLLM's processes, which import
# the shared modules (`wire`, `staging`, `transports`, `idle_spin`) through this package, load none of the
# trainer's room (the syncer, requests, rljax.config).
_EXPORTS = {
    "CanaryError": "canary", "CanarySpec": "canary", "check_canary": "canary", "make_canary": "canary",
    "Bucket": "staging", "stage_buckets": "staging",
    "SyncOptions": "syncer", "WeightSyncer": "syncer", "WeightSyncError": "syncer",
    "TensorEntry": "wire", "read_checkpoint_spec": "wire",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
