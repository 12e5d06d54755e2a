"""`VLLMEngine`: the rollout servers (owned or connected), the rollout client and the weight syncer.

    engine = VLLMEngine.launch(model_path, workdir)          # or VLLMEngine.connect(urls, model_path)
    completions = engine.generate(prompt_ids, n=8, temperature=1.0, max_tokens=64, stop_token_ids=[eos])
    metrics = engine.push_weights(models.iter_hf_tensors(cfg, params), step, trainer_logprobs=fn)
    engine.recover(models.iter_hf_tensors(cfg, params), step, trainer_logprobs=fn)  # after a fault

Every push goes to every server (`WeightSyncer`), each answers the canary, and each must then report the
pushed version (`/weight_info`); `recover` restarts every owned server that died or hung, at once.

`model_path` is the local checkpoint directory the servers loaded: the syncer checks names and shapes
against its safetensors headers and sizes the canary from its `config.json` (vocabulary) and the servers'
KV block size.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import requests

from rljax.config import DEFAULTS
from rljax.rollout.auth import bearer_headers, new_token
from rljax.rollout.client import ClientOptions, Completion, RolloutClient
from rljax.rollout.server import ServerOptions, VLLMServer
from rljax.weight_sync.canary import DEFAULT_BLOCK_SIZE, TrainerLogprobs, make_canary, server_block_size
from rljax.weight_sync.gate import PolicyGate
from rljax.weight_sync.syncer import SyncOptions, WeightSyncer, WeightSyncError
from rljax.weight_sync.wire import read_checkpoint_spec


def served_model_name(url: str, timeout_s: float = 10.0, headers: dict | None = None) -> str:
    """The id of the (single) model a server serves, from `/v1/models`."""
    r = requests.get(url + "/v1/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def canary_block_size(urls: Sequence[str], headers: dict | None = None) -> int:
    """The largest KV block size among the servers (what the canary's prompt must span), vLLM's largest
    default where a server does not report it."""
    return max(server_block_size(u, headers=headers) or DEFAULT_BLOCK_SIZE for u in urls)


class VLLMEngine:
    """Generation + verified weight push over one or more vLLM servers; see the module docstring."""

    def __init__(
        self,
        urls: Sequence[str],
        model_path: str | os.PathLike,
        *,
        servers: Sequence[VLLMServer] = (),
        client_options: ClientOptions = ClientOptions(),
        sync_options: SyncOptions = SyncOptions(),
        version: int = 0,
        token: str | None = None,
    ):
        self.urls, self.model_path, self.servers = list(urls), str(model_path), list(servers)
        # One bearer token for all servers: given, or the one the owned servers were started with.
        tokens = {s.token for s in self.servers}
        if token is None and len(tokens) > 1:
            raise ValueError("VLLMEngine: the owned servers have different tokens; pass one token to all")
        self.token = token if token is not None else next(iter(tokens), None)
        headers = bearer_headers(self.token)
        self.gate = PolicyGate(version)
        model = served_model_name(self.urls[0], headers=headers)
        vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
        self.client = RolloutClient(
            self.urls, model, gate=self.gate, options=client_options, token=self.token
        )
        self.syncer = WeightSyncer(
            self.urls,
            model,
            spec=read_checkpoint_spec(model_path),
            canary=make_canary(vocab, block_size=canary_block_size(self.urls, headers)),
            gate=self.gate,
            options=sync_options,
            headers=headers,
        )

    @classmethod
    def launch(
        cls,
        model_path: str | os.PathLike,
        workdir: str | os.PathLike,
        *,
        replicas: int = DEFAULTS.rollout.vllm.num_servers,
        host: str = DEFAULTS.rollout.vllm.host,
        server_options: ServerOptions = ServerOptions(),
        **kwargs,
    ) -> VLLMEngine:
        """Starts `replicas` servers at once, each on its own port (logs in `workdir/replica_<i>/`, one
        fresh bearer token for all) and connects to them; their weight-transfer backend is named after
        `sync_options.transport` (one engine class takes both) and their workers map buckets only from
        `sync_options.staging_dir`."""
        sync = kwargs.get("sync_options")
        if sync is not None:
            server_options = dataclasses.replace(
                server_options, weight_transfer_backend=sync.transport, staging_dir=sync.staging_dir
            )
        servers, token = [], new_token()
        try:
            for i in range(replicas):
                path = Path(workdir) / f"replica_{i}"
                servers.append(VLLMServer(model_path, path, host=host, options=server_options, token=token))
                servers[-1].spawn()
            for s in servers:
                s.wait_healthy(server_options.startup_timeout_s)
            return cls([s.url for s in servers], model_path, servers=servers, **kwargs)
        except BaseException:
            for s in servers:
                s.stop()
            raise

    @classmethod
    def connect(cls, urls: Sequence[str], model_path: str | os.PathLike, **kwargs) -> VLLMEngine:
        """Uses servers started elsewhere (same host for the "shm" transport, any host for "tcp")."""
        return cls(urls, model_path, **kwargs)

    @property
    def version(self) -> int:
        return self.gate.version

    def generate(self, prompts: Sequence[Sequence[int]], **sampling) -> list[Completion]:
        """See `RolloutClient.generate`."""
        return self.client.generate(prompts, **sampling)

    def push_weights(
        self, tensors: Iterable[tuple[str, np.ndarray]], version: int, *, trainer_logprobs: TrainerLogprobs
    ) -> dict[str, float]:
        """See `WeightSyncer.sync`, then checks every server's served version; returns the weight_sync/*
        metrics. Raises WeightSyncError naming a server that serves another version."""
        metrics = self.syncer.sync(tensors, version, trainer_logprobs)
        for url in self.urls:
            served = self.syncer.server_version(url)
            if served != str(version):
                raise WeightSyncError(f"{url} serves weight version {served!r} after pushing {version}")
        return metrics

    def recover(
        self, tensors: Iterable[tuple[str, np.ndarray]], version: int, *, trainer_logprobs: TrainerLogprobs
    ) -> dict[str, float]:
        """Restarts owned servers that died or stopped answering `/health`, then re-pushes the full state
        (which also repairs a live server left with mixed weights by a failed sync)."""
        self.restart_unhealthy()
        self.syncer.reset()
        return self.push_weights(tensors, version, trainer_logprobs=trainer_logprobs)

    def restart_unhealthy(self) -> list[VLLMServer]:
        """Restarts (all at once) the owned servers that died or do not answer `/health`; returns them."""
        dead = [s for s in self.servers if not s.healthy()]
        for s in dead:
            s.stop()
            s.spawn()
        for s in dead:
            s.wait_healthy(s.options.startup_timeout_s)
        return dead

    def metrics(self) -> dict[str, float]:
        return self.client.metrics()

    def close(self) -> None:
        self.client.close()
        self.syncer.close()
        for s in self.servers:
            s.stop()
