"""The typed, nested run config: schema (one default per field), parsing, validation.

    schema.py          the frozen dataclasses and their defaults (`Config`, `DEFAULTS`), derived values
                       (`serving_dtype`, `canary_tolerance`)
    parsing.py         ConfigDict / dict / `--config.a.b=v` overrides -> `Config`, and back (`to_dict`)
    validation.py      `validate`: cross-field facts that need no devices; `mesh_shape`
    packing_checks.py  the packed layout's part of `validate` (packing, micro-batches, shared prompts)
    runtime_checks.py  `validate_runtime`: the mesh, the model directory, the tokenizer

Everything public is re-exported here: `from rljax.config import Config, validate` is the way to use it.
"""

from rljax.config.parsing import (
    REMOVED_FIELDS,
    default_config_dict,
    field_types,
    from_config_dict,
    parse_override,
    suggest,
    to_config_dict,
    to_dict,
)
from rljax.config.runtime_checks import (
    check_chat_template,
    check_mesh_divides_model,
    read_model_config,
    validate_runtime,
)
from rljax.config.schema import (
    CANARY_TOLERANCES,
    DEFAULTS,
    FP8_SERVING,
    SANDBOX_MODES,
    TRANSPORTS,
    AlgoConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    VLLMConfig,
    WeightSyncConfig,
    canary_tolerance,
    serving_dtype,
)
from rljax.config.validation import algo_family, is_loopback_host, mesh_shape, validate, vllm_is_cpu_build

__all__ = [
    "CANARY_TOLERANCES",
    "FP8_SERVING",
    "DEFAULTS",
    "REMOVED_FIELDS",
    "SANDBOX_MODES",
    "TRANSPORTS",
    "AlgoConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "MeshConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "VLLMConfig",
    "WeightSyncConfig",
    "algo_family",
    "canary_tolerance",
    "check_chat_template",
    "check_mesh_divides_model",
    "default_config_dict",
    "field_types",
    "from_config_dict",
    "is_loopback_host",
    "mesh_shape",
    "parse_override",
    "read_model_config",
    "serving_dtype",
    "suggest",
    "to_config_dict",
    "to_dict",
    "validate",
    "validate_runtime",
    "vllm_is_cpu_build",
]
