"""`RolloutEngine`: the one trainer-side boundary to vLLM: servers, generation, the weight push, recovery.

    engine = RolloutEngine.launch(model_path, workdir)          # or RolloutEngine.connect(urls, ...)
    completions = engine.generate(prompt_ids, n=8, temperature=1.0, max_tokens=64, stop_token_ids=[eos])
    snapshot = weights.snapshot(params)                          # the trainer's side (rljax.loop.engine)
    metrics = engine.push_weights(snapshot, version)             # weight_sync/* and recovery/*
    engine.start_push(snapshot, version, on_served=...)          # async mode: delivered off this thread
    engine.close()

A push goes one way: the trainer takes a snapshot of its weights (`rljax.rollout.pushing.Snapshot`: cast to
the serving dtype, the canary's trainer side started), the engine pushes that value, and nothing calls
back. The engine is composition of small parts, each usable alone:
- `client` (`RolloutClient`): generation over every server, under the policy gate;
- `syncer` (`WeightSyncer`): staging, pause, load, finish as the version, canary, resume; in a LoRA run
  the weight channel is an `AdapterPublisher` instead (each version a runtime-loaded adapter, no pause);
- `recovery` (`rljax.rollout.recovery.Recovery`): the owned servers' restarts, re-pushing the last
  pushed version, one recovery at a time;
- `pusher` (`rljax.rollout.pushing.WeightPush`): a verified push with recovery (every server must then
  serve the version: vLLM's `/weight_info`, published by a successful `finish_weight_update`);
- `background` (`rljax.rollout.background.BackgroundPush`): async mode's push on its own thread.

Recovery (`max_restarts` > 0): a `generate` or `push_weights` that fails with a recoverable error (a dead or
hung server) restarts every owned server that died or stopped answering, re-pushes the last pushed weights
and version (from a copy the engine keeps) and resubmits the call; after `max_restarts` restarts in a row
the call raises `RecoveryExhaustedError`. A server that crashes again after a restart with the same root-
cause line in its log (a deterministic engine crash) ends the call at once with `EngineCrashError` quoting
that line and naming the log: it stops within one restart. One recovery runs at a time (a lock shared by the
loop and the async push's thread); a caller whose failure predates a recovery that already happened just
retries. Until the re-push the gate is broken: a generate call that comes in meanwhile fails, waits for the
recovery and is resubmitted, instead of sampling a restarted server's checkpoint under the previous
version's label. With `max_restarts` = 0 the first error is raised as it is.

`model_path` is the local checkpoint directory the servers loaded: the syncer checks names and shapes
against its safetensors headers and sizes the canary from its `config.json` (vocabulary) and the servers'
KV block size. This module and everything it imports run in the trainer's process: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from rljax.config import DEFAULTS
from rljax.hf_config import read_hf_config
from rljax.rollout import placement
from rljax.rollout.auth import bearer_headers
from rljax.rollout.background import BackgroundPush
from rljax.rollout.client import ClientOptions, Completion, RolloutClient
from rljax.rollout.pushing import Snapshot, WeightPush
from rljax.rollout.recovery import Recovery
from rljax.rollout.server import ServerOptions, VLLMServer, launch_servers, served_model_name
from rljax.weight_sync.adapters import AdapterPublisher
from rljax.weight_sync.canary import DEFAULT_BLOCK_SIZE, CanarySpec, make_canary, server_block_size
from rljax.weight_sync.gate import PolicyGate
from rljax.weight_sync.syncer import SyncOptions, WeightSyncer
from rljax.weight_sync.wire import read_checkpoint_spec


def canary_block_size(urls: Sequence[str], headers: dict | None = None) -> int:
    """The largest KV block size among the servers (what the canary's prompt must span), vLLM's largest
    default where a server does not report it."""
    return max(server_block_size(u, headers=headers) or DEFAULT_BLOCK_SIZE for u in urls)


class Generation:
    """`generate(prompts, **sampling)`: `client.generate` with recovery; a call resubmitted after a
    recovery counts its prompts as recovery/resubmitted."""

    def __init__(self, client: RolloutClient, recovery: Recovery):
        self.client, self.recovery = client, recovery

    def generate(self, prompts: Sequence[Sequence[int]], **sampling) -> list[Completion]:
        recovery, attempt = self.recovery, {"n": 0, "epoch": self.recovery.epoch}

        def op():
            attempt["n"], attempt["epoch"] = attempt["n"] + 1, recovery.epoch
            if attempt["n"] > 1:
                recovery.count({"recovery/resubmitted": float(len(prompts))})
            return self.client.generate(prompts, **sampling)

        return recovery.call(op, lambda: recovery.recover_from(attempt["epoch"]), "generate")


class RolloutEngine:
    """Generation + verified weight push + recovery over one or more vLLM servers; see the module docstring.

    Built from its parts (`client`, `syncer`, owned `servers`); `launch` and `connect` build them.
    """

    def __init__(
        self,
        client: RolloutClient,
        syncer: WeightSyncer | AdapterPublisher,
        *,
        servers: Sequence[VLLMServer] = (),
        token: str | None = None,
        max_restarts: int = 0,
    ):
        self.client, self.syncer, self.servers, self.token = client, syncer, list(servers), token
        self.recovery = Recovery(self.servers, syncer, client.gate, max_restarts)
        self.generation = Generation(client, self.recovery)
        self.pusher = WeightPush(syncer, self.recovery)
        self.background = BackgroundPush(self.pusher.push)
        self.unpin_cpus: tuple[int, ...] = ()  # set by whoever pinned this process (host placement)

    @classmethod
    def launch(
        cls,
        model_path: str | os.PathLike,
        workdir: str | os.PathLike,
        *,
        replicas: int = DEFAULTS.rollout.vllm.num_servers,
        host: str = DEFAULTS.rollout.vllm.host,
        server_options: ServerOptions = ServerOptions(),
        sync_options: SyncOptions = SyncOptions(),
        **kwargs,
    ) -> RolloutEngine:
        """Starts `replicas` owned servers (`launch_servers`) and connects to them; their weight-transfer
        backend is named after `sync_options.transport` and their workers map buckets only from
        `sync_options.staging_dir`."""
        server_options = dataclasses.replace(
            server_options,
            weight_transfer_backend=sync_options.transport,
            staging_dir=sync_options.staging_dir,
        )
        servers = launch_servers(model_path, workdir, replicas=replicas, host=host, options=server_options)
        try:
            urls = [s.url for s in servers]
            return cls.connect(urls, model_path, servers=servers, sync_options=sync_options, **kwargs)
        except BaseException:
            for s in servers:
                s.stop()
            raise

    @classmethod
    def connect(
        cls,
        urls: Sequence[str],
        model_path: str | os.PathLike,
        *,
        servers: Sequence[VLLMServer] = (),
        client_options: ClientOptions = ClientOptions(),
        sync_options: SyncOptions = SyncOptions(),
        version: int = 0,
        token: str | None = None,
        lora_root: str | os.PathLike | None = None,
        **kwargs,
    ) -> RolloutEngine:
        """An engine over servers at `urls` (owned `servers`, or started elsewhere: same host for the "shm"
        transport, any host for "tcp"); `token` defaults to the owned servers' one. `lora_root`: a LoRA
        run, whose versions are adapters written there and loaded by the servers at run time (the
        weight channel is a `weight_sync.adapters.AdapterPublisher`, not a `WeightSyncer`)."""
        tokens = {s.token for s in servers}
        if token is None and len(tokens) > 1:
            raise ValueError("RolloutEngine: the owned servers have different tokens; pass one token to all")
        token = token if token is not None else next(iter(tokens), None)
        headers, gate = bearer_headers(token), PolicyGate(version)
        model = served_model_name(urls[0], headers=headers)
        vocab = read_hf_config(model_path)["vocab_size"]
        canary = make_canary(vocab, block_size=canary_block_size(urls, headers))
        if lora_root is not None:
            adapters = AdapterPublisher(
                list(urls),
                Path(lora_root),
                model,
                canary=canary,
                gate=gate,
                headers=headers,
                canary_tolerance=sync_options.canary_tolerance,
            )
            policy = adapters.lease  # each generate call samples with the adapter current when it starts
            client = RolloutClient(urls, model, gate=gate, options=client_options, token=token, policy=policy)
            return cls(client, adapters, servers=servers, token=token, **kwargs)
        client = RolloutClient(urls, model, gate=gate, options=client_options, token=token)
        syncer = WeightSyncer(
            list(urls),
            model,
            spec=read_checkpoint_spec(model_path),
            canary=canary,
            gate=gate,
            options=sync_options,
            headers=headers,
        )
        return cls(client, syncer, servers=servers, token=token, **kwargs)

    @property
    def urls(self) -> list[str]:
        return self.client.urls

    @property
    def gate(self) -> PolicyGate:
        return self.client.gate

    @property
    def version(self) -> int:
        return self.gate.version

    @property
    def canary(self) -> CanarySpec:
        """The question every push's canary asks (the snapshot's trainer side answers it)."""
        return self.syncer.canary

    def generate(self, prompts: Sequence[Sequence[int]], **sampling) -> list[Completion]:
        """See `RolloutClient.generate`; a dead or hung server is recovered and the call resubmitted."""
        return self.generation.generate(prompts, **sampling)

    def push_weights(self, snapshot: Snapshot, version: int) -> dict[str, float]:
        """Pushes `snapshot` to every server as policy `version`, verified by the canary and each server's
        served version; returns weight_sync/* metrics and the recovery/* counts since the previous push.
        A `start_push` still in flight is delivered (or raised) first."""
        self.background.wait()
        return self.pusher.push(snapshot, version)

    def start_push(
        self, snapshot: Snapshot, version: int, on_served: Callable[[int], None] | None = None
    ) -> None:
        """`push_weights`, delivered on a background thread once the trainer's side is done (the
        snapshot's `keep()`: its canary answers and a host copy); `on_served(version)` when the servers
        serve it, verified. Waits for the previous such push first and raises its failure."""
        self.background.start(snapshot, version, on_served)

    def wait_pushed(self) -> None:
        """Waits for the push `start_push` began (if any); raises its failure."""
        self.background.wait()

    def pushed_metrics(self) -> dict[str, float]:
        """weight_sync/* and recovery/* of the `start_push` pushes delivered since the last call."""
        return self.background.metrics()

    def restart_unhealthy(self) -> list[VLLMServer]:
        """See `Recovery.restart_unhealthy` (a full push must follow)."""
        return self.recovery.restart_unhealthy()

    def metrics(self) -> dict[str, float]:
        """rollout/* metrics of the generate calls since the last call."""
        return self.client.metrics()

    def close(self) -> None:
        """Stops the client, the syncer and the owned servers; gives pinned cores back."""
        self.background.close()  # the push in flight first: it uses the client and the syncer
        self.client.close()
        self.syncer.close()
        for s in self.servers:
            s.stop()
        if self.unpin_cpus:  # the trainer's threads get back the cores they had before the server started
            placement.pin_process(self.unpin_cpus)
