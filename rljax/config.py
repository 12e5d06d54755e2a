"""The typed, nested config schema: one default per field, in one place.

`configs/*.py` files build an `ml_collections.ConfigDict` from `default_config_dict()` and change a few
fields; `from_config_dict` turns the (possibly overridden) ConfigDict into frozen dataclasses, rejecting
unknown keys (with the closest valid names), wrong types and values outside a field's choices.
`validate` checks cross-field facts that need no devices; `validate_runtime` checks the ones that do.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import ml_collections


class ConfigError(ValueError):
    """A user error in the config. `field` is the dotted name of the bad field."""

    def __init__(self, field_name: str, message: str | None = None):
        # One-argument form: libraries that re-raise `type(e)(str(e))` (config_flags) keep working.
        super().__init__(field_name if message is None else f"{field_name}: {message}")
        self.field = field_name.split(":", 1)[0] if message is None else field_name


def _choice(default: str, *choices: str):
    """A str field whose value must be one of `choices` (checked by `from_config_dict`)."""
    return field(default=default, metadata={"choices": choices})


# ---------------------------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class AlgoConfig:
    family: str = _choice("grpo", "grpo", "ppo")  # grpo: group-relative advantages, no critic
    advantage: str = "grpo"  # a name in rljax.algos.ADVANTAGES (ppo uses GAE instead)
    adv_std_scale: str = _choice("group", "group", "batch", "none")
    adv_eps: float = 1e-6
    policy_loss: str = "ppo_clip"  # a name in rljax.algos.POLICY_LOSSES
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO's clip-higher sets this above clip_low
    dual_clip_c: float = 0.0  # 0 disables dual clip; otherwise must be > 1
    aggregation: str = "token_mean"  # a name in rljax.algos.LOSS_AGGREGATIONS
    beta: float = 0.0  # KL-to-reference coefficient; 0 means no reference policy is computed
    kl_estimator: str = "k3"  # a name in rljax.algos.KL_ESTIMATORS
    entropy_coef: float = 0.0
    is_level: str = _choice("token", "none", "token", "sequence", "geometric")  # rljax.algos.IS_LEVELS
    is_mode: str = _choice("truncate", "truncate", "mask")
    is_cap: float = 2.0
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards all agree, refill from new prompts
    max_refill_rounds: int = 3
    overlong_buffer: int = 0  # DAPO soft overlong penalty over this many tokens before max_tokens
    overlong_penalty: float = 1.0
    gamma: float = 1.0  # PPO / GAE
    lam: float = 1.0
    whiten_advantages: bool = True  # PPO: normalise GAE advantages over the batch's loss tokens
    vf_coef: float = 0.5
    value_clip: float = 0.2  # 0 disables value clipping


@dataclass(frozen=True)
class ModelConfig:
    path: str = "assets/tiny_arith"  # local HF checkpoint dir (config.json + *.safetensors + tokenizer)
    param_dtype: str = _choice("float32", "float32", "bfloat16")
    compute_dtype: str = _choice("float32", "float32", "bfloat16")
    # Per-layer rematerialisation: a name in rljax.models.REMAT_POLICIES (none, full, dots_saveable, ...).
    # "full" keeps only each layer's input for the backward pass: what long sequences on real models need.
    remat: str = "full"
    # A name in rljax.models.ATTENTION_IMPLS, or "auto" (GPU: cuDNN through jax.nn.dot_product_attention,
    # TPU: Pallas splash attention, CPU: blockwise online-softmax attention in plain JAX).
    attention_impl: str = "auto"
    attention_block_size: int = 512  # query/key block of the blockwise attention (tokens)
    # The decoder class: "auto" (the built-in NNX decoder of the checkpoint's architecture), a name in
    # rljax.models.DECODERS (qwen2, qwen3, llama), or "package.module:Class" (bring your own model,
    # docs/models.md; its HF table maps its params onto the checkpoint's tensor names).
    family: str = "auto"


@dataclass(frozen=True)
class VLLMConfig:
    urls: tuple = ()  # existing servers; empty: rljax starts and owns `num_servers`
    num_servers: int = 1  # owned servers (each on its own port of `host`, one token for all)
    tensor_parallel_size: int = 1  # of each owned server (vLLM --tensor-parallel-size)
    data_parallel_size: int = 1  # of each owned server (vLLM --data-parallel-size)
    host: str = "127.0.0.1"  # owned servers bind here; a non-loopback host needs allow_remote
    allow_remote: bool = False  # allow a non-loopback host (every route still needs the run's bearer token)
    token_file: str = ""  # servers in `urls`: a 0600 file with their bearer token ("" = they need none)
    port: int = 0  # 0 picks a free port
    gpu_memory_utilization: float = 0.15  # on CPU: fraction of host RAM reserved
    kvcache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on the CPU build
    max_model_len: int = 512
    # KV-cache block of owned servers (--block-size), a multiple of 32 (CPU and CUDA backends take it);
    # 0: vLLM's default (128 on CPU). The canary's prompt spans 2 blocks, so small blocks keep it cheap.
    block_size: int = 32
    startup_timeout_s: float = 300.0
    # A request fails (and is retried elsewhere) when its server processed no token for this long; a long
    # generation that progresses never times out.
    no_progress_timeout_s: float = 120.0
    max_retries: int = 2
    max_restarts: int = 3  # restarts of a dead/hung server (re-sync, resubmit) before the run stops
    extra_args: tuple = ()
    # Cores of an owned server and the trainer on one host (rljax.rollout.placement): auto splits them when
    # generation overlaps the update (max_staleness > 0) on >= 4 cores and leaves the trainer all cores
    # otherwise; none: vLLM's own binding, trainer unpinned; split: the split always.
    placement: str = _choice("auto", "auto", "none", "split")
    # An idle vLLM worker's busy-poll before it sleeps (vLLM's own: 1 s, a core the trainer then lacks);
    # a few ms still cover the gap between decode steps.
    idle_spin_s: float = 0.002


@dataclass(frozen=True)
class WeightSyncConfig:
    transport: str = _choice("shm", "shm", "tcp", "zmq")  # shm: this host; tcp/zmq: streamed (transports)
    tcp_host: str = "127.0.0.1"  # tcp/zmq: this trainer's address as the servers reach it (bound to sync)
    tcp_timeout_s: float = 30.0  # tcp/zmq: connect and per-receive timeout (a dead peer fails within it)
    bucket_mb: int = 64
    # The dtype vLLM serves in and the weights are cast to (on device) before staging: "" or "auto" = the
    # master dtype (model.param_dtype); bfloat16 halves the bytes moved and serves like bf16-compute presets.
    dtype: str = _choice("", "", "auto", "float32", "bfloat16", "float16")
    # 0: from the serving dtype (CANARY_TOLERANCES); > 0 overrides it.
    canary_tolerance: float = 0.0
    checksums: bool = False


# The canary's tolerance per serving dtype (max |trainer - vLLM| log-prob on its tokens). float32: trainer
# and engine agree to ~1e-5 on sampled tokens; the canary's random tokens sit at log-probs of -20..-30 on a
# trained model, where fp32 rounding reaches ~2e-4. Broken syncs differ by >= 0.1. bfloat16/float16: the
# engine's weights are rounded (and it computes in that dtype) while the trainer uses its float32 masters:
# measured on the default job (real vLLM CPU, bf16 serving, f32 masters, 40 steps): canary max |dlogp| per
# sync median 0.18, max 0.38 (so 0.5; a thin margin: recheck on real models); float16 (3 more mantissa
# bits, ~8x finer) scaled from it, not measured.
CANARY_TOLERANCES = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.1}


def serving_dtype(cfg: Config) -> str:
    """The dtype vLLM serves in: `rollout.weight_sync.dtype`, or the master dtype for "" / "auto"."""
    dtype = cfg.rollout.weight_sync.dtype
    return cfg.model.param_dtype if dtype in ("", "auto") else dtype


def canary_tolerance(cfg: Config) -> float:
    """`rollout.weight_sync.canary_tolerance`, or the serving dtype's entry in `CANARY_TOLERANCES` for 0."""
    return cfg.rollout.weight_sync.canary_tolerance or CANARY_TOLERANCES[serving_dtype(cfg)]


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = _choice("vllm", "vllm")
    env: str = ""  # "" = single-turn completions; else a multi-turn environment in rljax.envs.ENVS
    batch_size: int = 64  # completions per step (= prompts per step * group_size)
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_tokens: int = 16
    stop_token_ids: tuple = ()
    eval_temperature: float = 1.0  # eval/accuracy = expected pass@1 at the sampling temperature
    max_in_flight: int = 64  # requests outstanding per server (each goes to the least loaded one)
    vllm: VLLMConfig = VLLMConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()


# rljax.rewards.sandbox.MODES (config may not import the host-only rewards package; a test keeps them equal)
SANDBOX_MODES = ("namespace", "audit")


@dataclass(frozen=True)
class RewardConfig:
    functions: tuple = ("math",)  # names in rljax.rewards.REWARDS or "package.module:function"
    weights: tuple = (1.0,)
    eval_function: str = "math"  # the verifier behind eval/accuracy (a score >= 0.5 counts as correct)
    timeout_s: float = 5.0
    num_workers: int = 2
    # Code sandbox (docs/security.md): "namespace" fails closed where it cannot run; "audit" is weaker and
    # only by explicit choice. Each private tmpfs (/tmp, /dev/shm, /var/tmp) in MB; one run's CPU share.
    sandbox: str = "namespace"
    sandbox_tmpfs_mb: int = 64
    sandbox_cpus: float = 1.0

    def sandbox_settings(self) -> dict[str, Any]:
        """RewardPool(sandbox=...): the settings its workers pass to rljax.rewards.sandbox.configure."""
        return {"mode": self.sandbox, "tmpfs_mb": self.sandbox_tmpfs_mb, "cpus": self.sandbox_cpus}


@dataclass(frozen=True)
class DataConfig:
    source: str = "arithmetic"  # a name in rljax.data.SOURCES
    # (name, value) pairs for the source; the default is the task assets/tiny_arith was built for.
    source_options: tuple = (("num_examples", 4000), ("max_value", 19), ("ops", ("+",)))
    path: str = ""  # for file sources
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    template: str = "{prompt}"  # str.format over the example; applies to plain-text prompts only
    # true: render each prompt with the tokenizer's own chat template (add_generation_prompt=True), token
    # for token what vLLM's chat endpoint builds; a plain-text prompt becomes one user message, and a source
    # may yield conversations (a list of {"role", "content"} messages, TRL's convention) as the prompt.
    chat_template: bool = False
    system_prompt: str = ""  # chat_template only: a system message put before conversations without one
    eval_size: int = 64  # prompts held out for eval/accuracy; 0 holds none out and switches eval off
    seed: int = 0


@dataclass(frozen=True)
class OptimConfig:
    name: str = _choice("adamw", "adamw", "sgd")
    learning_rate: float = 1e-4
    schedule: str = _choice("constant", "constant", "cosine")
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1  # -1: all remaining devices
    tensor: int = 1
    # A mesh axis that does not divide a tensor dimension it shards is an error; true replicates that
    # dimension over the axis instead (small test models on many devices).
    allow_replication: bool = False
    device_memory_gib: float = 0.0  # per-device memory budget for the compiled step; 0: the device's own


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    every_steps: int = 10
    keep_last: int = 3
    keep_every: int = 0  # also keep every K-th step forever; 0 disables
    async_save: bool = True
    # Also write each step's LossInputs batch to workdir/batches/step_<S>.npz (the batch trained on from
    # checkpoint S), so `python -m rljax.replay` can re-run that update and check it against checkpoint S+1.
    save_batches: bool = False


@dataclass(frozen=True)
class MetricsConfig:
    tensorboard: bool = True
    console: bool = True
    wandb_project: str = ""  # empty disables Weights & Biases
    wandb_mode: str = _choice("offline", "offline", "online")
    # Steps (as numbered in metrics.jsonl, 1..trainer.steps) to trace with jax.profiler into
    # workdir/profile/ (TensorBoard's profile plugin, or the perfetto_trace.json.gz in ui.perfetto.dev).
    profile_steps: tuple = ()
    # Peak FLOP/s of one device for `perf/mfu`; 0: the device kind's dense bf16 peak from
    # rljax.metrics.PEAK_BF16_FLOPS, and where the kind is not listed (CPU) perf/mfu is left out.
    peak_flops_per_device: float = 0.0


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = 40
    seed: int = 0
    max_staleness: int = 0  # 0 = synchronous; k: rollouts may lag the policy by up to k versions
    micro_batch_size: int = 0  # 0 = the whole minibatch in one pass
    # > 0: sequences are packed into rows of this many tokens (rljax.trainer.packing) and a micro-batch is
    # one packed row per data-parallel device; 0: one sequence per row, padded to a length bucket.
    tokens_per_micro_batch: int = 0
    epochs: int = 1  # update passes over each rollout batch
    minibatches: int = 1  # optimizer steps per epoch
    max_nonfinite_skips: int = 3  # consecutive skipped (non-finite) updates before the run stops
    eval_every: int = 10  # eval before step 1, every N versions and at the end; 0 switches eval off
    logprob_impl: str = "auto"  # a name in rljax.kernels implementations


@dataclass(frozen=True)
class Config:
    algo: AlgoConfig = AlgoConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    trainer: TrainerConfig = TrainerConfig()


# ------------------------------------------------------------------------------------------- conversion
def _fields(cls) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        f.type = hints[f.name]
        out[f.name] = f
    return out


def field_types(cls=Config, prefix: str = "") -> dict[str, type]:
    """Every leaf field as `dotted.name -> type` (nested dataclasses flattened)."""
    out: dict[str, type] = {}
    for name, f in _fields(cls).items():
        if dataclasses.is_dataclass(f.type):
            out.update(field_types(f.type, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = f.type
    return out


def suggest(key: str, valid: list[str]) -> str:
    """'; did you mean a, b?' for the closest valid names (by whole key and by last component)."""
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    if not close:
        tail = key.rsplit(".", 1)[-1]
        close = [v for v in valid if v.rsplit(".", 1)[-1] == tail][:3]
    return f"; did you mean {', '.join(close)}?" if close else ""


def to_config_dict(cfg: Config | None = None) -> ml_collections.ConfigDict:
    """The ConfigDict form of `cfg` (default: all defaults); config files start from this."""
    cfg = cfg if cfg is not None else Config()

    def convert(obj):
        if dataclasses.is_dataclass(obj):
            return {f.name: convert(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return obj

    return ml_collections.ConfigDict(convert(cfg))


default_config_dict = to_config_dict


def _coerce(name: str, typ: type, value: Any) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    elif typ is tuple:
        if isinstance(value, (tuple, list)):
            return tuple(value)
    raise ConfigError(name, f"expected {typ.__name__}, got {type(value).__name__} {value!r}")


def _build(cls, data: Any, prefix: str):
    if isinstance(data, ml_collections.ConfigDict):
        data = data.to_dict()
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", f"expected a section, got {data!r}")
    fields = _fields(cls)
    valid = sorted(field_types(Config))
    for key in data:
        if key not in fields:
            full = f"{prefix}{key}"
            raise ConfigError(full, f"unknown config key{suggest(full, valid)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        full = f"{prefix}{name}"
        if dataclasses.is_dataclass(f.type):
            kwargs[name] = _build(f.type, data[name], full + ".")
            continue
        value = _coerce(full, f.type, data[name])
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(full, f"{value!r} is not one of {', '.join(map(repr, choices))}")
        kwargs[name] = value
    return cls(**kwargs)


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> Config:
    """Typed `Config` from a ConfigDict; raises ConfigError on unknown keys, wrong types, bad choices."""
    return _build(Config, cd, "")


def parse_override(key: str, text: str) -> Any:
    """Parses a command-line override `--config.<key>=<text>` to the field's type; ConfigError if bad."""
    types_ = field_types(Config)
    if key not in types_:
        raise ConfigError(key, f"unknown config key{suggest(key, sorted(types_))}")
    typ = types_[key]
    if typ is str:
        return text
    if typ is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(key, f"expected bool (true/false), got {text!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(key, f"expected {typ.__name__}, got {text!r}") from None
    if typ is tuple and not isinstance(value, (tuple, list)):
        value = (value,)
    return _coerce(key, typ, value)


def to_dict(cfg: Config) -> dict:
    """A plain, JSON-serializable dict of the resolved config (saved with every checkpoint)."""
    return to_config_dict(cfg).to_dict()


# ------------------------------------------------------------------------------------------- validation
def _positive(cfg: Config) -> list[tuple[str, Any]]:
    return [
        ("optim.learning_rate", cfg.optim.learning_rate),
        ("trainer.steps", cfg.trainer.steps),
        ("trainer.epochs", cfg.trainer.epochs),
        ("trainer.minibatches", cfg.trainer.minibatches),
        ("trainer.max_nonfinite_skips", cfg.trainer.max_nonfinite_skips),
        ("rollout.batch_size", cfg.rollout.batch_size),
        ("rollout.group_size", cfg.rollout.group_size),
        ("rollout.max_tokens", cfg.rollout.max_tokens),
        ("rollout.temperature", cfg.rollout.temperature),
        ("rollout.weight_sync.bucket_mb", cfg.rollout.weight_sync.bucket_mb),
        ("rollout.weight_sync.tcp_timeout_s", cfg.rollout.weight_sync.tcp_timeout_s),
        ("reward.timeout_s", cfg.reward.timeout_s),
        ("reward.num_workers", cfg.reward.num_workers),
        ("reward.sandbox_tmpfs_mb", cfg.reward.sandbox_tmpfs_mb),
        ("reward.sandbox_cpus", cfg.reward.sandbox_cpus),
        ("checkpoint.every_steps", cfg.checkpoint.every_steps),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
        ("model.attention_block_size", cfg.model.attention_block_size),
        ("algo.is_cap", cfg.algo.is_cap),
        ("rollout.vllm.gpu_memory_utilization", cfg.rollout.vllm.gpu_memory_utilization),
        ("rollout.vllm.startup_timeout_s", cfg.rollout.vllm.startup_timeout_s),
    ]


# (field, lo, hi): lo <= value <= hi, for fields `_positive` does not cover (or bounds it from above).
_RANGES = (
    ("rollout.vllm.port", 0, 65535),  # 0 picks a free port
    ("rollout.vllm.max_model_len", 1, math.inf),
    ("rollout.vllm.gpu_memory_utilization", 0.0, 1.0),  # and > 0: `_positive`
    ("rollout.vllm.kvcache_space_gib", 0, math.inf),
    ("rollout.eval_temperature", 0.0, math.inf),
    ("rollout.weight_sync.canary_tolerance", 0.0, math.inf),  # 0: from the serving dtype
    ("reward.num_workers", 1, 256),  # each is a Python process with its own sandboxes
    ("optim.warmup_steps", 0, math.inf),
    ("optim.weight_decay", 0.0, math.inf),
    ("optim.b1", 0.0, 1.0),
    ("optim.b2", 0.0, 1.0),
    ("optim.eps", 0.0, math.inf),
    ("optim.max_grad_norm", 0.0, math.inf),
    ("algo.clip_low", 0.0, 1.0),
    ("algo.clip_high", 0.0, math.inf),
    ("algo.beta", 0.0, math.inf),
    ("algo.adv_eps", 0.0, math.inf),
    ("algo.gamma", 0.0, 1.0),
    ("algo.lam", 0.0, 1.0),
    ("algo.vf_coef", 0.0, math.inf),
    ("algo.value_clip", 0.0, math.inf),
    ("algo.overlong_buffer", 0, math.inf),
    ("algo.overlong_penalty", 0.0, math.inf),
    ("algo.max_refill_rounds", 0, math.inf),
    ("data.eval_size", 0, math.inf),
    ("data.seed", 0, 2**32 - 1),
    ("trainer.seed", 0, 2**32 - 1),
    ("trainer.eval_every", 0, math.inf),
    ("checkpoint.keep_every", 0, math.inf),
    ("metrics.peak_flops_per_device", 0.0, math.inf),
)


def _value(cfg: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def _check_ranges(cfg: Config) -> None:
    """Every float field and reward weight is finite; the `_RANGES` fields lie in their ranges."""
    for key, typ in field_types(Config).items():
        if typ is float and not math.isfinite(_value(cfg, key)):
            raise ConfigError(key, f"must be a finite number, got {_value(cfg, key)!r}")
    for weight in cfg.reward.weights:
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ConfigError("reward.weights", f"must be finite numbers, got {weight!r}")
    for key, lo, hi in _RANGES:
        value = _value(cfg, key)
        if not lo <= value <= hi:
            bounds = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
            raise ConfigError(key, f"must be {bounds}, got {value!r}")
    if cfg.rollout.vllm.max_model_len <= cfg.rollout.max_tokens:
        raise ConfigError(
            "rollout.vllm.max_model_len",
            f"{cfg.rollout.vllm.max_model_len} leaves no room for a prompt before "
            f"rollout.max_tokens={cfg.rollout.max_tokens} completion tokens",
        )


def _check_names(cfg: Config) -> None:
    from rljax import algos
    from rljax.models.attention import ATTENTION_IMPLS
    from rljax.models.remat import REMAT_POLICIES

    if cfg.model.attention_impl != "auto" and cfg.model.attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(
            "model.attention_impl",
            f"unknown name {cfg.model.attention_impl!r}; valid: auto, {', '.join(ATTENTION_IMPLS.names())}",
        )
    if cfg.model.family != "auto":
        from rljax.models.model import resolve_decoder

        try:
            resolve_decoder(cfg.model.family)
        except (KeyError, ValueError) as e:
            raise ConfigError("model.family", str(e).strip('"')) from None
    for key, registry, name in [
        ("model.remat", REMAT_POLICIES, cfg.model.remat),
        ("algo.advantage", algos.ADVANTAGES, cfg.algo.advantage),
        ("algo.policy_loss", algos.POLICY_LOSSES, cfg.algo.policy_loss),
        ("algo.aggregation", algos.LOSS_AGGREGATIONS, cfg.algo.aggregation),
        ("algo.kl_estimator", algos.KL_ESTIMATORS, cfg.algo.kl_estimator),
    ]:
        if name not in registry:
            raise ConfigError(key, f"unknown name {name!r}; valid: {', '.join(registry.names())}")
    if cfg.reward.sandbox not in SANDBOX_MODES:
        valid = ", ".join(SANDBOX_MODES)
        raise ConfigError("reward.sandbox", f"unknown mode {cfg.reward.sandbox!r}; valid: {valid}")


def is_loopback_host(host: str) -> bool:
    """True for `localhost` and loopback IP literals (127.0.0.0/8, ::1); False for any other name."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _private_file(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return os.path.isfile(path) and not st.st_mode & 0o077


def validate(cfg: Config) -> Config:
    """Checks cross-field facts that need no devices; raises ConfigError naming the field. Returns cfg."""
    _check_ranges(cfg)
    for key, value in _positive(cfg):
        if not value > 0:
            raise ConfigError(key, f"must be > 0, got {value!r}")
    ro, tr = cfg.rollout, cfg.trainer
    if ro.batch_size % ro.group_size:
        raise ConfigError(
            "rollout.batch_size",
            f"{ro.batch_size} is not divisible by rollout.group_size={ro.group_size}",
        )
    if cfg.algo.family == "grpo" and ro.group_size < 2:
        raise ConfigError("rollout.group_size", "GRPO needs at least 2 samples per prompt")
    if not 0.0 < ro.top_p <= 1.0:
        raise ConfigError("rollout.top_p", f"must be in (0, 1], got {ro.top_p}")
    if ro.top_k < 0:
        raise ConfigError("rollout.top_k", f"must be >= 0 (0 disables), got {ro.top_k}")
    # The engine reports processed log-probs (renormalised over the top-k / top-p set); the trainer scores
    # the untruncated softmax at the sampler's temperature. Truncated sampling would make every ratio and
    # the IS correction silently wrong, so training rollouts must not truncate.
    if ro.top_p != 1.0:
        raise ConfigError(
            "rollout.top_p",
            f"training rollouts need top_p = 1.0 (got {ro.top_p}): the trainer's log-probs are the "
            "untruncated softmax, the engine's would be renormalised over the nucleus",
        )
    if ro.top_k != 0:
        raise ConfigError(
            "rollout.top_k",
            f"training rollouts need top_k = 0 (off; got {ro.top_k}): the trainer's log-probs are the "
            "untruncated softmax, the engine's would be renormalised over the top-k tokens",
        )
    if tr.max_staleness < 0:
        raise ConfigError("trainer.max_staleness", f"must be >= 0, got {tr.max_staleness}")
    for key in ("max_retries", "max_restarts"):
        if getattr(ro.vllm, key) < 0:
            raise ConfigError(f"rollout.vllm.{key}", f"must be >= 0, got {getattr(ro.vllm, key)}")
    if ro.vllm.idle_spin_s < 0:
        raise ConfigError("rollout.vllm.idle_spin_s", f"must be >= 0, got {ro.vllm.idle_spin_s}")
    if not ro.vllm.no_progress_timeout_s > 0:
        raise ConfigError(
            "rollout.vllm.no_progress_timeout_s", f"must be > 0, got {ro.vllm.no_progress_timeout_s}"
        )
    counts = {
        "rollout.max_in_flight": ro.max_in_flight,
        "rollout.vllm.num_servers": ro.vllm.num_servers,
        "rollout.vllm.tensor_parallel_size": ro.vllm.tensor_parallel_size,
        "rollout.vllm.data_parallel_size": ro.vllm.data_parallel_size,
    }
    for key, value in counts.items():
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
    if ro.vllm.urls and ro.vllm.num_servers != 1:
        raise ConfigError(
            "rollout.vllm.num_servers",
            f"{ro.vllm.num_servers} owned servers and rollout.vllm.urls (connected servers) are exclusive",
        )
    if not (ro.vllm.urls or ro.vllm.allow_remote or is_loopback_host(ro.vllm.host)):
        raise ConfigError(
            "rollout.vllm.host",
            f"{ro.vllm.host!r} is not a loopback address: the server's weight-update routes would be "
            "reachable from other hosts; set rollout.vllm.allow_remote=true to allow it (token-protected)",
        )
    if ro.vllm.token_file and not _private_file(ro.vllm.token_file):
        raise ConfigError(
            "rollout.vllm.token_file", f"{ro.vllm.token_file!r} must be an existing file with mode 0600"
        )
    if ro.vllm.block_size < 0 or ro.vllm.block_size % 32:
        raise ConfigError(
            "rollout.vllm.block_size",
            f"must be 0 (vLLM's default) or a positive multiple of 32, got {ro.vllm.block_size}",
        )
    if ro.batch_size % tr.minibatches:
        raise ConfigError(
            "trainer.minibatches", f"{tr.minibatches} does not divide rollout.batch_size={ro.batch_size}"
        )
    minibatch = ro.batch_size // tr.minibatches
    if tr.micro_batch_size < 0 or (tr.micro_batch_size and minibatch % tr.micro_batch_size):
        raise ConfigError(
            "trainer.micro_batch_size",
            f"{tr.micro_batch_size} must be 0 or divide the minibatch size {minibatch}",
        )
    _validate_packing(cfg)
    _validate_prompts_and_profile(cfg)
    if cfg.algo.dual_clip_c and cfg.algo.dual_clip_c <= 1.0:
        raise ConfigError("algo.dual_clip_c", f"must be 0 (off) or > 1, got {cfg.algo.dual_clip_c}")
    if len(cfg.reward.functions) != len(cfg.reward.weights) or not cfg.reward.functions:
        raise ConfigError(
            "reward.weights",
            f"needs one weight per reward function: {len(cfg.reward.functions)} functions, "
            f"{len(cfg.reward.weights)} weights",
        )
    if not cfg.mesh.device_memory_gib >= 0:
        raise ConfigError(
            "mesh.device_memory_gib", f"must be >= 0 (0: the device's own), got {cfg.mesh.device_memory_gib}"
        )
    _validate_mesh_sizes(cfg.mesh)
    _check_names(cfg)
    return cfg


def _validate_packing(cfg: Config) -> None:
    tr = cfg.trainer
    if tr.tokens_per_micro_batch < 0:
        raise ConfigError(
            "trainer.tokens_per_micro_batch", f"must be >= 0 (0: no packing), got {tr.tokens_per_micro_batch}"
        )
    if not tr.tokens_per_micro_batch:
        return
    if tr.micro_batch_size:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"must be 0 with packing (trainer.tokens_per_micro_batch={tr.tokens_per_micro_batch}): "
            "a micro-batch is then one packed row per data-parallel device",
        )
    if cfg.algo.family == "ppo":
        raise ConfigError(
            "trainer.tokens_per_micro_batch",
            "packing is for the GRPO family; PPO's value targets are per row (set it to 0)",
        )
    if tr.tokens_per_micro_batch <= cfg.rollout.max_tokens:
        raise ConfigError(
            "trainer.tokens_per_micro_batch",
            f"{tr.tokens_per_micro_batch} cannot hold a prompt and "
            f"rollout.max_tokens={cfg.rollout.max_tokens} completion tokens",
        )


def _validate_prompts_and_profile(cfg: Config) -> None:
    if cfg.data.system_prompt and not cfg.data.chat_template:
        raise ConfigError(
            "data.system_prompt",
            "is a chat message: it needs data.chat_template=true (or put it in data.template)",
        )
    if cfg.data.chat_template and cfg.rollout.env:
        raise ConfigError(
            "data.chat_template",
            f"applies to single-turn prompts; rollout.env={cfg.rollout.env!r} builds its own conversation",
        )
    steps = cfg.metrics.profile_steps
    bad = [
        s for s in steps if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= cfg.trainer.steps
    ]
    if bad:
        raise ConfigError(
            "metrics.profile_steps",
            f"{bad!r} are not step numbers in [1, trainer.steps={cfg.trainer.steps}], e.g. (3, 4)",
        )


def check_chat_template(data: DataConfig, tokenizer_path: str) -> None:
    """ConfigError on data.chat_template when the checkpoint's tokenizer has no chat template (loads the
    tokenizer the run will use, so what is checked is what renders)."""
    if not data.chat_template:
        return
    from rljax import models

    try:
        tokenizer = models.load_tokenizer(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ConfigError("model.path", f"cannot load its tokenizer: {type(e).__name__}: {e}") from e
    if not tokenizer.chat_template:
        raise ConfigError(
            "data.chat_template",
            f"the tokenizer in {tokenizer_path!r} has no chat template (chat_template.jinja, or "
            "chat_template in tokenizer_config.json); add one or set data.chat_template=false",
        )


def _validate_mesh_sizes(mesh: MeshConfig) -> None:
    sizes = {"mesh.data": mesh.data, "mesh.fsdp": mesh.fsdp, "mesh.tensor": mesh.tensor}
    for key, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(key, f"must be a positive size or -1 (the rest), got {size}")
    if sum(s == -1 for s in sizes.values()) > 1:
        raise ConfigError("mesh", "at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")


def mesh_shape(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Resolved sizes {data, fsdp, tensor} for `num_devices`; ConfigError when they cannot multiply to it."""
    _validate_mesh_sizes(mesh)
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    known = 1
    for s in sizes.values():
        known *= s if s > 0 else 1
    for name, s in sizes.items():
        if s == -1:
            if num_devices % known:
                raise ConfigError(
                    f"mesh.{name}",
                    f"-1 cannot fill {num_devices} devices: the other axes multiply to {known}",
                )
            sizes[name] = num_devices // known
    product = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    if product != num_devices:
        raise ConfigError(
            "mesh",
            f"data*fsdp*tensor = {sizes['data']}*{sizes['fsdp']}*{sizes['tensor']} = {product}, "
            f"but there are {num_devices} devices",
        )
    return sizes


def validate_runtime(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks that need the machine, before anything is allocated: mesh vs device count, the model
    directory, the micro-batch vs data parallelism, (unless `mesh.allow_replication`) that every mesh
    axis divides each dimension the sharding rules give it (`check_mesh_divides_model`), and that the
    tokenizer has a chat template when `data.chat_template` is set. Returns mesh sizes."""
    sizes = mesh_shape(cfg.mesh, num_devices)
    path = cfg.model.path
    if not os.path.isdir(path):
        raise ConfigError("model.path", f"no such directory: {path!r} (a local Hugging Face checkpoint)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("model.path", f"{path!r} has no config.json (not a Hugging Face checkpoint)")
    data_parallel = sizes["data"] * sizes["fsdp"]
    minibatch = cfg.rollout.batch_size // cfg.trainer.minibatches
    micro = cfg.trainer.micro_batch_size or minibatch
    # Packed rows are rounded up to a multiple of data*fsdp by the packer; only unpacked rows must split.
    if not cfg.trainer.tokens_per_micro_batch and micro % data_parallel:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"the micro-batch of {micro} sequences is not divisible by data*fsdp = {data_parallel}",
        )
    if not cfg.mesh.allow_replication:
        decoder = "" if cfg.model.family == "auto" else cfg.model.family
        check_mesh_divides_model(read_model_config(path, decoder), sizes)
    check_chat_template(cfg.data, path)
    return sizes


# rljax.models (and so JAX) is imported inside the two functions below, not at the top: rljax.config is
# read by the CLI before it sets the platform and device-count flags that JAX reads (rljax.runtime).
def read_model_config(path: str, decoder: str = "") -> Any:
    """The `rljax.models.ModelConfig` (shapes only, no weights) of the checkpoint's `config.json`
    (`decoder`: the decoder class, see `ModelConfig.decoder`)."""
    from rljax import models

    try:
        with open(os.path.join(path, "config.json")) as f:
            return models.ModelConfig.from_hf_dict(json.load(f), decoder=decoder)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as e:
        # any malformed config.json (not JSON, not an object, missing or ill-typed or zero sizes)
        raise ConfigError("model.path", f"{path}/config.json: {type(e).__name__}: {e}") from e


def check_mesh_divides_model(model_config: Any, sizes: dict[str, int]) -> None:
    """ConfigError naming `mesh.<axis>` (or `mesh` when several fail) when a mesh axis of size > 1 does not
    divide a dimension the logical rules shard on it, for every parameter (`param_logical_axes`) and the
    attention activations sharded over heads (`attention.queries`, per token `[H, head_dim]`) and KV
    heads (`attention.keys`, `attention.values`: `[K, head_dim]`). One line per tensor, with the valid
    sizes (`rljax.sharding.check_divisibility`). `sizes`: resolved {data, fsdp, tensor}."""
    from rljax import models, sharding

    c = model_config
    attention = {
        "queries": sharding.LogicalAxes(("heads", "head_dim"), (c.num_heads, c.head_dim)),
        "keys": sharding.LogicalAxes(("kv", "head_dim"), (c.num_kv_heads, c.head_dim)),
        "values": sharding.LogicalAxes(("kv", "head_dim"), (c.num_kv_heads, c.head_dim)),
    }
    problems = sharding.divisibility_problems({**models.param_logical_axes(c), "attention": attention}, sizes)
    if not problems:
        return
    axes = sorted({p.axis for p in problems}, key=list(sizes).index)
    raise ConfigError(
        f"mesh.{axes[0]}" if len(axes) == 1 else "mesh",
        "; ".join(map(str, problems))
        + " (set mesh.allow_replication=true to replicate these dimensions over the mesh axis instead)",
    )
