"""Host-staged, verified weight sync from the trainer into running vLLM servers (see `syncer`).

The worker side (`vllm_engine`, loaded by vLLM through `vllm_plugin`) imports torch and vLLM; nothing
imported here does.
"""

from rljax.weight_sync.canary import CanaryError, CanarySpec, check_canary, make_canary
from rljax.weight_sync.staging import Bucket, stage_buckets
from rljax.weight_sync.syncer import SyncOptions, WeightSyncer, WeightSyncError
from rljax.weight_sync.wire import TensorEntry, read_checkpoint_spec

__all__ = [
    "Bucket",
    "CanaryError",
    "CanarySpec",
    "SyncOptions",
    "TensorEntry",
    "WeightSyncError",
    "WeightSyncer",
    "check_canary",
    "make_canary",
    "read_checkpoint_spec",
    "stage_buckets",
]
