"""The typed, nested config schema: one default per field, in one place.

Every field of a run has its default here (`Config()`); engine-side option classes (`ServerOptions`,
`SyncOptions`, `ClientOptions`) take theirs from `DEFAULTS`, the config of all defaults. Parsing
(ConfigDict, overrides) is in `rljax.config.parsing`, cross-field checks in `rljax.config.validation`.
This module imports nothing heavy: the CLI reads it before JAX's platform flags are set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    family: str = _choice("grpo", "grpo", "ppo")  # rljax.algos.FAMILIES; grpo: group-relative, no critic
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

    @property
    def needs_reference(self) -> bool:
        """Whether the run computes reference-policy log-probs (and keeps the reference params): beta > 0.
        Every place that asks reads this, not the coefficient."""
        return self.beta > 0


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
    # Query/key block of the blockwise attention (tokens); it reads only the blocks the mask lets a query
    # block see, so packed rows of short sequences run fastest in small blocks (CPU: 64).
    attention_block_size: int = 512
    # Layers per iteration of the scanned stack (jax.lax.scan's unroll): 1 compiles one layer body whatever
    # the depth; the stack's depth runs it straight-line (XLA fuses across layers, no per-layer weight
    # slices: ~9% of a small model's update on CPU); 0 (auto): straight-line up to
    # rljax.models.AUTO_UNROLL_MAX_LAYERS layers, else 1.
    unroll_layers: int = 0
    # The decoder class: "auto" (the built-in NNX decoder of the checkpoint's architecture), a name in
    # rljax.models.DECODERS (qwen2, qwen3, llama), or "package.module:Class" (bring your own model,
    # docs/models.md; its HF table maps its params onto the checkpoint's tensor names).
    family: str = "auto"
    # LoRA (docs/lora.md): rank 0 trains every parameter; r > 0 trains only low-rank adapters on the
    # `lora_targets` modules (regexes matched against a module's name or path; the default is
    # rljax.models.config.LORA_TARGETS, the attention and MLP projections) with PEFT's scale alpha / r.
    # No dropout: the trainer's log-probs must equal the rollout engine's (which has none) to float32.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class VLLMConfig:
    urls: tuple = ()  # existing servers; empty: rljax starts and owns `num_servers`
    num_servers: int = 1  # owned servers (each on its own port of `host`, one token for all)
    tensor_parallel_size: int = 1  # of each owned server (vLLM --tensor-parallel-size)
    data_parallel_size: int = 1  # of each owned server (vLLM --data-parallel-size)
    host: str = "127.0.0.1"  # owned servers bind here; a non-loopback host needs allow_remote
    allow_remote: bool = False  # allow a non-loopback host (every route still needs the run's bearer token)
    token_file: str = ""  # servers in `urls`: a 0600 file with their bearer token ("" = they need none)
    gpu_memory_utilization: float = 0.15  # on CPU: fraction of host RAM reserved
    # On GPU (rljax.device_plan): GPUs of the first node given to the owned servers, the trainer keeping
    # the others (split); 0: the servers share the trainer's GPUs (colocated).
    server_gpus: int = 0
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


TRANSPORTS = ("shm", "tcp", "zmq")  # weight-sync transports (equal to rljax.weight_sync.transports: a test)


@dataclass(frozen=True)
class WeightSyncConfig:
    transport: str = _choice("shm", *TRANSPORTS)  # shm: this host; tcp/zmq: streamed (weight_sync.transports)
    # tcp/zmq: the trainer's address as the servers reach it; one per trainer host, comma-separated (each
    # process serves its own shards on the address that is its host's)
    tcp_host: str = "127.0.0.1"
    tcp_timeout_s: float = 30.0  # tcp/zmq: connect and per-receive timeout (a dead peer fails within it)
    bucket_mb: int = 64
    # The dtype vLLM serves in and the weights are cast to (on device) before staging: "" or "auto" = the
    # master dtype (model.param_dtype); bfloat16 halves the bytes moved and serves like bf16-compute presets;
    # float8_e4m3: projections in fp8 with per-tensor scales (rljax.weight_sync.fp8; vLLM's CUDA build only).
    dtype: str = _choice("", "", "auto", "float32", "bfloat16", "float16", "float8_e4m3")
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
# float8_e4m3: not measured (no fp8 engine on these machines); e4m3 keeps 3 mantissa bits to bf16's 7.
CANARY_TOLERANCES = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.1, "float8_e4m3": 1.0}
FP8_SERVING = "float8_e4m3"


def serving_dtype(cfg: Config) -> str:
    """The dtype vLLM serves in: `rollout.weight_sync.dtype`, or the master dtype for "" / "auto"."""
    dtype = cfg.rollout.weight_sync.dtype
    return cfg.model.param_dtype if dtype in ("", "auto") else dtype


def canary_tolerance(cfg: Config) -> float:
    """`rollout.weight_sync.canary_tolerance`, or the serving dtype's entry in `CANARY_TOLERANCES` for 0."""
    return cfg.rollout.weight_sync.canary_tolerance or CANARY_TOLERANCES[serving_dtype(cfg)]


@dataclass(frozen=True)
class RolloutConfig:
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
    # Keyword options of named rewards, ((name, ((key, value), ...)), ...), e.g.
    # (("math", (("extract", "hash"),)),): a name's options apply wherever it is used (functions, eval).
    options: tuple = ()
    timeout_s: float = 5.0
    num_workers: int = 2
    # Code sandbox (docs/security.md): "namespace" fails closed where it cannot run; "audit" is weaker and
    # only by explicit choice. Each private tmpfs (/tmp, /dev/shm, /var/tmp) in MB; one run's CPU share.
    sandbox: str = "namespace"
    sandbox_tmpfs_mb: int = 64
    sandbox_cpus: float = 1.0

    def validate(self) -> None:
        """One weight per function; `options` well-formed and naming a reward this config uses (whether each
        key fits its function is checked where rewards are resolved, `rljax.loop.inputs.check_rewards`)."""
        if len(self.functions) != len(self.weights) or not self.functions:
            raise ConfigError(
                "reward.weights",
                f"needs one weight per reward function: {len(self.functions)} functions, "
                f"{len(self.weights)} weights",
            )
        named = {*self.functions, self.eval_function}
        valid = "pairs (name, ((key, value), ...)) naming a reward in reward.functions or eval_function"

        def is_pair(x, first_ok) -> bool:
            return isinstance(x, tuple) and len(x) == 2 and first_ok(x[0])

        for entry in self.options:
            ok = is_pair(entry, lambda name: name in named) and isinstance(entry[1], tuple)
            if not ok or not all(is_pair(p, lambda key: isinstance(key, str)) for p in entry[1]):
                raise ConfigError("reward.options", f"must be {valid}, got {entry!r}")

    def options_for(self, name: str) -> dict[str, Any]:
        """The keyword options `options` gives reward `name` ({} when none)."""
        return {key: value for n, pairs in self.options if n == name for key, value in pairs}

    def specs(self) -> list[tuple[str, float, dict[str, Any]]]:
        """RewardPool's specs for the training reward: (name, weight, options) per function."""
        pairs = zip(self.functions, self.weights, strict=True)
        return [(name, float(weight), self.options_for(name)) for name, weight in pairs]

    def eval_spec(self) -> tuple[str, float, dict[str, Any]]:
        """RewardPool's spec for the verifier behind eval/accuracy."""
        return (self.eval_function, 1.0, self.options_for(self.eval_function))

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
    # On GPU: the share of each device JAX preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION, set before JAX
    # starts); 0: planned (rljax.device_plan: 0.95 less a colocated server's share, else 0.90).
    gpu_memory_fraction: float = 0.0


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
    packed_rows_per_micro_batch: int = 1  # packed rows per device per micro-batch; 0: whole minibatch
    # packing: completions of one prompt store it once per packed row (same log-probs and loss; a group
    # of G costs one prompt, not G). Built-in decoders and the xla attention paths (not splash).
    share_prompts: bool = False
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


# The config of all defaults: engine-side options (rljax.rollout.server.ServerOptions, ...) take their
# defaults from here, so each default is declared once (tests/test_config.py checks that none is restated).
DEFAULTS = Config()
