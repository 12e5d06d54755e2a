"""Serving dtype apart from the master dtype: the config's derived values and the on-device cast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax import config as C
from rljax import distributed
from rljax.distributed import cast_params


def test_serving_dtype_follows_master_unless_set():
    cfg = C.Config()
    assert C.serving_dtype(cfg) == cfg.model.param_dtype == "float32"
    assert C.canary_tolerance(cfg) == C.CANARY_TOLERANCES["float32"]
    for auto in ("", "auto"):
        cfg = C.from_config_dict({"rollout": {"weight_sync": {"dtype": auto}}})
        assert C.serving_dtype(cfg) == "float32"
    cfg = C.from_config_dict({"rollout": {"weight_sync": {"dtype": "bfloat16"}}})
    assert C.serving_dtype(cfg) == "bfloat16"
    assert C.canary_tolerance(cfg) == C.CANARY_TOLERANCES["bfloat16"]
    cfg = C.from_config_dict({"rollout": {"weight_sync": {"dtype": "bfloat16", "canary_tolerance": 0.5}}})
    assert C.canary_tolerance(cfg) == 0.5  # an explicit tolerance wins


def test_unknown_serving_dtype_lists_the_choices():
    with pytest.raises(C.ConfigError, match="bfloat16"):
        C.from_config_dict({"rollout": {"weight_sync": {"dtype": "int8"}}})


def _sharded_params():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("fsdp",))
    shard = NamedSharding(mesh, PartitionSpec("fsdp", None))
    w = jax.device_put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 7.0, shard)
    return {"w": w, "step": jnp.int32(3)}, shard


def test_cast_keeps_shardings_and_gathers_nothing():
    params, shard = _sharded_params()
    out = cast_params(params, "bfloat16")
    assert out["w"].dtype == jnp.bfloat16 and out["step"].dtype == jnp.int32
    assert out["w"].sharding.is_equivalent_to(shard, 2)  # each device casts its own shard: nothing replicated
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(params["w"]).astype(jnp.bfloat16))
    text = distributed._cast.lower(params, jnp.dtype("bfloat16")).compile().as_text()
    assert "all-gather" not in text and "all-reduce" not in text and "collective-permute" not in text
    assert cast_params(params, None) is params and cast_params(params, "float32") is params
