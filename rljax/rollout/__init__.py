"""Rollouts from vLLM: owned or connected servers, an async token-in/token-out client, the engine facade."""

from rljax.rollout.client import ClientOptions, Completion, RolloutClient, RolloutError
from rljax.rollout.engine import VLLMEngine, served_model_name
from rljax.rollout.server import ServerError, ServerOptions, VLLMServer, free_port
from rljax.weight_sync.gate import PolicyGate

__all__ = [
    "ClientOptions",
    "Completion",
    "PolicyGate",
    "RolloutClient",
    "RolloutError",
    "ServerError",
    "ServerOptions",
    "VLLMEngine",
    "VLLMServer",
    "free_port",
    "served_model_name",
]
