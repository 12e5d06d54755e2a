"""The worker room: the weight-sync code that runs inside vLLM's processes, and the only rljax code that
imports torch or vLLM.

- `plugin`: the `vllm.general_plugins` entry point vLLM calls in each of its processes; registers one
  weight-transfer backend per transport name and quiets idle workers' spinning.
- `engine`: the backend itself (`ShmWeightTransferEngine`), loaded by vLLM by name in each worker: maps
  or pulls the buckets the trainer staged, checks their checksums, loads the tensors into the model.
- `fanout`: one receiver per node for streamed buckets (each node pulls each byte once).

Nothing in the trainer's room (`rljax.weight_sync`, `rljax.rollout`, `rljax.loop`) imports this package:
vLLM loads it, by name (`tests/test_layering.py`). It reads the wire format (`wire`, `staging`), the
transports' names and clients (`transports`) and the idle-spin settings (`idle_spin`) from the shared
modules of `rljax.weight_sync`. This file imports nothing, so `import rljax.weight_sync.worker.fanout`
pulls in no torch.
"""
