"""vLLM plugin (entry point `vllm.general_plugins: rljax_weight_transfer`): one backend per transport.

vLLM calls `register()` in every process that loads plugins (API server, engine core, workers), so it
must be idempotent and cheap: the engine module (torch, vllm internals) is imported lazily by the factory
only where the backend is actually built.
"""

from __future__ import annotations

import os

from rljax.weight_sync.idle_spin import IDLE_RECHECK_MS, IDLE_SPIN_ENV
from rljax.weight_sync.transports import NAMES

# One engine for every transport name: each update's `update_info` says whether its buckets are files to
# map ("shm": trainer and server on one host) or bytes to pull from a trainer's bucket server (its `source`).
BACKENDS = {name: ("rljax.weight_sync.worker.engine", "ShmWeightTransferEngine") for name in NAMES}


def register() -> None:
    """Adds rljax's backends to `WeightTransferEngineFactory` (a no-op for names already present)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    quiet_idle_spin()  # idle workers sleep instead of spinning on a core the trainer needs

    for name, (module, cls) in BACKENDS.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, module, cls)


def quiet_idle_spin() -> None:
    """Inside a vLLM process: idle message-queue readers busy-poll for `RLJAX_VLLM_IDLE_SPIN_S` seconds
    (not vLLM's 1 s) before sleeping on their notify socket, re-checking the queue every
    `IDLE_RECHECK_MS` while asleep (not vLLM's 5 s). No-op when the variable is unset."""
    value = os.environ.get(IDLE_SPIN_ENV)
    if value is None:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # not a vLLM with this queue
        return
    init = shm_broadcast.SpinCondition.__init__
    if init.__defaults__ is not None and len(init.__defaults__) == 1:
        init.__defaults__ = (float(value),)
    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):  # read at each wait
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(
            shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, IDLE_RECHECK_MS
        )
