"""vLLM plugin (entry point `vllm.general_plugins: rljax_weight_transfer`): the "shm" and "tcp" backends.

vLLM calls `register()` in every process that loads plugins (API server, engine core, workers), so it
must be idempotent and cheap: the engine module (torch, vllm internals) is imported lazily by the factory
only where the backend is actually built.
"""

from __future__ import annotations

# One engine for both names: each update's `update_info` says whether its buckets are files to map
# ("shm": trainer and server on one host) or bytes to fetch from the trainer over a socket ("tcp").
BACKENDS = {
    "shm": ("rljax.weight_sync.vllm_engine", "ShmWeightTransferEngine"),
    "tcp": ("rljax.weight_sync.vllm_engine", "ShmWeightTransferEngine"),
}


def register() -> None:
    """Adds rljax's backends to `WeightTransferEngineFactory` (a no-op for names already present)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rljax.rollout.placement import quiet_idle_spin

    quiet_idle_spin()  # idle workers sleep instead of spinning on a core the trainer needs

    for name, (module, cls) in BACKENDS.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, module, cls)
