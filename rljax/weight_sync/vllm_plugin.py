"""vLLM plugin (entry point `vllm.general_plugins: rljax_weight_transfer`): one backend per transport.

vLLM calls `register()` in every process that loads plugins (API server, engine core, workers), so it
must be idempotent and cheap: the engine module (torch, vllm internals) is imported lazily by the factory
only where the backend is actually built.
"""

from __future__ import annotations

from rljax.weight_sync.transports import NAMES

# One engine for every transport name: each update's `update_info` says whether its buckets are files to
# map ("shm": trainer and server on one host) or bytes to pull from a trainer's bucket server (its `source`).
BACKENDS = {name: ("rljax.weight_sync.vllm_engine", "ShmWeightTransferEngine") for name in NAMES}


def register() -> None:
    """Adds rljax's backends to `WeightTransferEngineFactory` (a no-op for names already present)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rljax.rollout.placement import quiet_idle_spin

    quiet_idle_spin()  # idle workers sleep instead of spinning on a core the trainer needs

    for name, (module, cls) in BACKENDS.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, module, cls)
