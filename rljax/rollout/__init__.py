"""Rollouts from vLLM: owned or connected servers, an async token-in/token-out client, and `RolloutEngine`,
the one trainer-side boundary to vLLM (generation, weight push, recovery)."""

from rljax.rollout.client import ClientOptions, Completion, RolloutClient, RolloutError
from rljax.rollout.engine import RolloutEngine
from rljax.rollout.pushing import HostSnapshot, HostWeights, Snapshot
from rljax.rollout.recovery import EngineCrashError, RecoveryExhaustedError
from rljax.rollout.server import ServerError, ServerOptions, VLLMServer, free_port, served_model_name
from rljax.weight_sync.gate import PolicyGate

__all__ = [
    "ClientOptions",
    "Completion",
    "PolicyGate",
    "EngineCrashError",
    "RecoveryExhaustedError",
    "RolloutClient",
    "RolloutEngine",
    "RolloutError",
    "ServerError",
    "ServerOptions",
    "HostSnapshot",
    "HostWeights",
    "Snapshot",
    "VLLMServer",
    "free_port",
    "served_model_name",
]
