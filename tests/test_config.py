"""The typed config schema: conversion, unknown keys, types, choices, cross-field validation."""

import ast
import dataclasses
import importlib.util
import inspect
import json

import pytest

from rljax import config as C


def load_config_file(name, preset=None):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", f"configs/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(preset)


def test_roundtrip_defaults_is_identity():
    cfg = C.from_config_dict(C.default_config_dict())
    assert cfg == C.Config()
    assert C.from_config_dict(C.to_dict(cfg)) == cfg


def test_a_config_saved_as_json_reads_back_equal_and_valid():
    """What a run saves with its checkpoints (`to_dict` -> JSON) and `rljax.eval --workdir` reads back:
    nested pairs (`reward.options`, `data.source_options`) come back as tuples, not lists."""
    cfg = C.validate(C.from_config_dict(load_config_file("smollm2_math")))
    assert cfg.reward.options and cfg.data.source_options
    back = C.from_config_dict(json.loads(json.dumps(C.to_dict(cfg))))
    assert back == cfg
    C.validate(back)


def test_fixed_field_names_exist():
    names = C.field_types()
    for key in [
        "trainer.steps",
        "trainer.seed",
        "trainer.max_staleness",
        "mesh.data",
        "mesh.fsdp",
        "mesh.tensor",
        "checkpoint.every_steps",
        "model.path",
        "rollout.vllm.urls",
    ]:
        assert key in names, key
    for key in C.REMOVED_FIELDS:  # removed fields stay removed, and passing one says why
        assert key not in names, key
        with pytest.raises(C.ConfigError, match=f"{key}: removed: "):
            C.parse_override(key, "1")


def test_unknown_key_names_it_and_suggests():
    cd = C.default_config_dict().to_dict()
    cd["trainer"]["stpes"] = 3
    with pytest.raises(C.ConfigError) as e:
        C.from_config_dict(cd)
    assert e.value.field == "trainer.stpes"
    assert "did you mean trainer.steps" in str(e.value)


def test_wrong_type_is_rejected():
    cd = C.default_config_dict().to_dict()
    cd["trainer"]["steps"] = "ten"
    with pytest.raises(C.ConfigError, match="trainer.steps: expected int"):
        C.from_config_dict(cd)


def test_int_is_accepted_for_float_but_bool_is_not_int():
    cd = C.default_config_dict().to_dict()
    cd["optim"]["learning_rate"] = 1
    assert C.from_config_dict(cd).optim.learning_rate == 1.0
    cd["trainer"]["steps"] = True
    with pytest.raises(C.ConfigError, match="trainer.steps"):
        C.from_config_dict(cd)


def test_choice_field_lists_valid_values():
    cd = C.default_config_dict().to_dict()
    cd["algo"]["is_level"] = "tokens"
    with pytest.raises(C.ConfigError, match="algo.is_level: 'tokens' is not one of 'none', 'token'"):
        C.from_config_dict(cd)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"optim.learning_rate": 0.0}, "optim.learning_rate"),
        ({"optim.learning_rate": -1e-3}, "optim.learning_rate"),
        ({"rollout.batch_size": 30, "rollout.group_size": 8}, "rollout.batch_size"),
        ({"rollout.group_size": 1}, "rollout.group_size"),
        ({"rollout.top_p": 1.5}, "rollout.top_p"),
        ({"rollout.top_p": 0.9}, "rollout.top_p"),  # truncated sampling: trainer/engine log-probs differ
        ({"rollout.top_k": 5}, "rollout.top_k"),
        ({"trainer.max_staleness": -1}, "trainer.max_staleness"),
        ({"trainer.micro_batch_size": 5}, "trainer.micro_batch_size"),
        ({"algo.dual_clip_c": 0.5}, "algo.dual_clip_c"),
        ({"reward.weights": (1.0, 2.0)}, "reward.weights"),
        ({"mesh.fsdp": 0}, "mesh.fsdp"),
        ({"mesh.data": -1, "mesh.fsdp": -1}, "mesh"),
        ({"algo.advantage": "gpro"}, "algo.advantage"),
    ],
)
def test_validate_rejects_impossible_values(changes, field):
    cfg = C.Config()
    for key, value in changes.items():
        section, name = key.split(".")
        cfg = dataclasses.replace(
            cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})}
        )
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg)
    assert e.value.field == field


def replace_fields(cfg, changes: dict):
    """cfg with dotted fields (any depth, e.g. rollout.vllm.max_model_len) replaced."""
    for key, value in changes.items():
        *path, name = key.split(".")
        sections = [cfg]
        for part in path:
            sections.append(getattr(sections[-1], part))
        new = dataclasses.replace(sections[-1], **{name: value})
        for parent, part in zip(reversed(sections[:-1]), reversed(path), strict=True):
            new = dataclasses.replace(parent, **{part: new})
        cfg = new
    return cfg


@pytest.mark.parametrize(
    "changes, field, fragment",
    [
        ({"optim.learning_rate": float("inf")}, "optim.learning_rate", "finite"),
        ({"optim.learning_rate": float("nan")}, "optim.learning_rate", "finite"),
        ({"algo.beta": float("-inf")}, "algo.beta", "finite"),
        ({"reward.weights": (float("nan"),)}, "reward.weights", "finite"),
        ({"reward.weights": ("1",)}, "reward.weights", "finite"),
        ({"rollout.vllm.max_model_len": -512}, "rollout.vllm.max_model_len", ">= 1"),
        ({"rollout.vllm.max_model_len": 16}, "rollout.vllm.max_model_len", "no room for a prompt"),
        ({"rollout.vllm.kvcache_space_gib": -1}, "rollout.vllm.kvcache_space_gib", ">= 0"),
        ({"reward.num_workers": 1_000_000}, "reward.num_workers", "[1, 256]"),
        ({"rollout.vllm.gpu_memory_utilization": 1.5}, "rollout.vllm.gpu_memory_utilization", "[0.0, 1.0]"),
        ({"rollout.vllm.gpu_memory_utilization": 0.0}, "rollout.vllm.gpu_memory_utilization", "> 0"),
        ({"optim.b1": -0.1}, "optim.b1", "[0.0, 1.0]"),
        ({"algo.gamma": 1.5}, "algo.gamma", "[0.0, 1.0]"),
        ({"algo.beta": -0.01}, "algo.beta", ">= 0.0"),
        ({"trainer.seed": -1}, "trainer.seed", "[0, 4294967295]"),
        ({"data.eval_size": -1}, "data.eval_size", ">= 0"),
        ({"model.unroll_layers": -1}, "model.unroll_layers", ">= 0"),
        ({"rollout.weight_sync.canary_tolerance": -1.0}, "rollout.weight_sync.canary_tolerance", ">= 0.0"),
    ],
)
def test_validate_checks_finiteness_and_ranges(changes, field, fragment):
    with pytest.raises(C.ConfigError) as e:
        C.validate(replace_fields(C.Config(), changes))
    assert e.value.field == field and fragment in str(e.value), str(e.value)


def test_validate_accepts_range_edges():
    edges = {
        "reward.num_workers": 256,
        "rollout.vllm.gpu_memory_utilization": 1.0,
    }
    C.validate(replace_fields(C.Config(), edges))


def test_read_model_config_names_a_malformed_config_json(tmp_path):
    for text in ("{not json", "[]", json.dumps({"model_type": "qwen2", "hidden_size": "big"})):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(C.ConfigError, match="config.json"):
            C.read_model_config(str(tmp_path))


def test_mesh_shape_resolves_minus_one_and_checks_product():
    assert C.mesh_shape(C.MeshConfig(data=2, fsdp=-1, tensor=2), 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(C.ConfigError, match="= 12, but there are 8 devices"):
        C.mesh_shape(C.MeshConfig(data=3, fsdp=2, tensor=2), 8)
    with pytest.raises(C.ConfigError, match="-1 cannot fill 8 devices"):
        C.mesh_shape(C.MeshConfig(data=3, fsdp=-1, tensor=1), 8)


def test_validate_runtime_rejects_missing_model(tmp_path):
    cfg = C.Config(model=C.ModelConfig(path=str(tmp_path / "nope")))
    with pytest.raises(C.ConfigError, match="model.path: no such directory"):
        C.validate_runtime(cfg, 1)
    (tmp_path / "empty").mkdir()
    cfg = C.Config(model=C.ModelConfig(path=str(tmp_path / "empty")))
    with pytest.raises(C.ConfigError, match="has no config.json"):
        C.validate_runtime(cfg, 1)


def test_parse_override_types():
    assert C.parse_override("trainer.steps", "7") == 7
    assert C.parse_override("optim.learning_rate", "3e-4") == 3e-4
    assert C.parse_override("checkpoint.async_save", "false") is False
    assert C.parse_override("model.path", "/x/y") == "/x/y"
    assert C.parse_override("reward.functions", "('math', 'format')") == ("math", "format")
    with pytest.raises(C.ConfigError, match="expected int"):
        C.parse_override("trainer.steps", "seven")
    with pytest.raises(C.ConfigError, match="did you mean algo.beta"):
        C.parse_override("algo.bta", "0.1")


@pytest.mark.parametrize("name", ["grpo", "dapo", "drgrpo", "gspo", "ppo"])
def test_every_config_file_is_valid(name, monkeypatch):
    monkeypatch.syspath_prepend(".")
    cfg = C.validate(C.from_config_dict(load_config_file(name)))
    assert cfg.trainer.steps > 0
    assert C.validate(C.from_config_dict(load_config_file(name, "smoke"))).trainer.steps == 3


def test_presets_change_only_a_few_fields(monkeypatch):
    monkeypatch.syspath_prepend(".")
    grpo = flat(C.to_dict(C.from_config_dict(load_config_file("grpo"))))
    dapo = flat(C.to_dict(C.from_config_dict(load_config_file("dapo"))))
    assert grpo.keys() == dapo.keys() == C.field_types().keys()
    changed = [k for k in grpo if grpo[k] != dapo[k]]
    assert 0 < len(changed) <= 6, changed


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_unknown_preset_lists_valid(monkeypatch):
    monkeypatch.syspath_prepend(".")
    with pytest.raises(C.ConfigError, match="unknown preset 'big'; valid: smoke"):
        load_config_file("grpo", "big")


@pytest.mark.parametrize("block_size", [-32, 16, 48])
def test_validate_rejects_a_kv_block_size_vllm_cpu_cannot_take(block_size):
    cfg = C.Config()
    vllm = dataclasses.replace(cfg.rollout.vllm, block_size=block_size)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm=vllm))
    with pytest.raises(C.ConfigError, match="multiple of 32") as e:
        C.validate(cfg)
    assert e.value.field == "rollout.vllm.block_size"
    for ok in (0, 32, 64):  # 0: vLLM's default
        vllm = dataclasses.replace(cfg.rollout.vllm, block_size=ok)
        C.validate(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm=vllm)))


def qwen25_7b_dir(tmp_path):
    """A directory holding only Qwen2.5-7B's config.json (its shapes; no weights)."""
    from rljax.models.presets import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(PRESETS.get("qwen2.5-7b").to_hf_dict()))
    return str(tmp_path)


def runtime_config(path, **mesh):
    return C.Config(model=C.ModelConfig(path=path), mesh=C.MeshConfig(**mesh))


def test_validate_runtime_rejects_a_mesh_axis_that_does_not_divide_the_model(tmp_path):
    path = qwen25_7b_dir(tmp_path)
    with pytest.raises(C.ConfigError) as e:
        C.validate_runtime(runtime_config(path, fsdp=1, tensor=8), 8)
    assert e.value.field == "mesh.tensor"
    msg = str(e.value)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"layers.{name}.kernel: dimension " in msg, name
    for name in ("queries", "keys", "values"):  # the attention activations sharded over heads / KV heads
        assert f"attention.{name}: dimension 0 " in msg, name
    assert "('heads', size 28) is not divisible by mesh axis tensor=8 (valid tensor sizes: 1, 2, 4)" in msg
    assert "('kv', size 4) is not divisible by mesh axis tensor=8 (valid tensor sizes: 1, 2, 4)" in msg
    assert "mesh.allow_replication=true" in msg and "\n" not in msg  # one line for `rljax: error: ...`
    # Opting in keeps today's replication; a mesh that divides everything passes.
    sizes = C.validate_runtime(runtime_config(path, fsdp=1, tensor=8, allow_replication=True), 8)
    assert sizes == {"data": 1, "fsdp": 1, "tensor": 8}
    assert C.validate_runtime(runtime_config(path, fsdp=2, tensor=4), 8) == {
        "data": 1,
        "fsdp": 2,
        "tensor": 4,
    }
    assert C.validate_runtime(runtime_config(path), 8) == {"data": 1, "fsdp": 8, "tensor": 1}


def test_validate_runtime_names_every_failing_mesh_axis(tmp_path):
    path = qwen25_7b_dir(tmp_path)
    cfg = runtime_config(path, tensor=2)  # fsdp=-1 fills 3 of 6 devices: 3 does not divide hidden 3584
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, batch_size=48))
    with pytest.raises(C.ConfigError) as e:
        C.validate_runtime(cfg, 6)
    assert e.value.field == "mesh.fsdp" and "tensor=" not in str(e.value)
    want = "('embed', size 3584) is not divisible by mesh axis fsdp=3 (valid fsdp sizes: 1, 2, 4, 7, 8, 14,"
    assert want in str(e.value)
    cfg = dataclasses.replace(cfg, mesh=C.MeshConfig(fsdp=3, tensor=8))
    with pytest.raises(C.ConfigError) as e:
        C.validate_runtime(cfg, 24)
    assert e.value.field == "mesh" and "fsdp=3" in str(e.value) and "tensor=8" in str(e.value)


def test_validate_runtime_rejects_an_unreadable_model_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(C.ConfigError, match="model.path: .*config.json: JSONDecodeError"):
        C.validate_runtime(runtime_config(str(tmp_path)), 1)


def test_family_choices_are_the_registered_families():
    """algo.family's choices (for the one-line error at parse time) are rljax.algos.FAMILIES, the one
    registry of families; the trainer picks each family's builders from its entry (a critic: PPO's)."""
    from rljax.algos import FAMILIES
    from rljax.trainer import families, ppo, update

    choices = {f.name: f for f in dataclasses.fields(C.AlgoConfig)}["family"].metadata["choices"]
    assert sorted(choices) == FAMILIES.names()
    picked = {name: families._builders(_with_family(name))[1] for name in FAMILIES.names()}
    assert picked == {"grpo": update.make_update, "ppo": ppo.make_ppo_update}


def _with_family(name: str) -> C.Config:
    return dataclasses.replace(C.Config(), algo=dataclasses.replace(C.AlgoConfig(), family=name))


@pytest.mark.parametrize("family", ["grpo", "ppo"])
def test_family_facts_drive_validation(family):
    from rljax.algos import FAMILIES

    facts = FAMILIES.get(family)
    small = replace_fields(
        C.Config(), {"algo.family": family, "rollout.group_size": 1, "rollout.batch_size": 8}
    )
    if facts.min_group_size > 1:
        with pytest.raises(C.ConfigError, match=f"needs at least {facts.min_group_size} samples"):
            C.validate(small)
    else:
        C.validate(small)
    packed = replace_fields(C.Config(), {"algo.family": family, "trainer.tokens_per_micro_batch": 64})
    if facts.packing:
        C.validate(packed)
    else:
        with pytest.raises(C.ConfigError, match="packing is not available"):
            C.validate(packed)


def _class_defaults(cls) -> dict[str, ast.expr]:
    """field name -> the default expression in `cls`'s source (dataclass fields with a default)."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    return {
        s.target.id: s.value
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None
    }


def _literal(expr: ast.expr) -> bool:
    if isinstance(expr, (ast.Tuple, ast.List)):
        return all(_literal(e) for e in expr.elts)
    return isinstance(expr, ast.Constant) or (isinstance(expr, ast.UnaryOp) and _literal(expr.operand))


def engine_option_defaults() -> dict[tuple[type, str], object]:
    """(engine options class, field) -> its default derived from the config's defaults: every option the
    config sets. ServerOptions' fields are the ones `options_from_config` sets."""
    from rljax.rollout.client import ClientOptions
    from rljax.rollout.server import ServerOptions, options_from_config
    from rljax.weight_sync.syncer import SyncOptions

    d = C.DEFAULTS
    ws, vc = d.rollout.weight_sync, d.rollout.vllm
    out = {
        (SyncOptions, "bucket_bytes"): ws.bucket_mb * 2**20,
        (SyncOptions, "checksums"): ws.checksums,
        (SyncOptions, "canary_tolerance"): C.canary_tolerance(d),
        (SyncOptions, "transport"): ws.transport,
        (SyncOptions, "tcp_host"): ws.tcp_host,
        (SyncOptions, "tcp_timeout_s"): ws.tcp_timeout_s,
        (ClientOptions, "no_progress_timeout_s"): vc.no_progress_timeout_s,
        (ClientOptions, "max_retries"): vc.max_retries,
        (ClientOptions, "max_in_flight"): d.rollout.max_in_flight,
    }
    from_config = options_from_config(d)
    call = next(
        n
        for n in ast.walk(ast.parse(inspect.getsource(options_from_config)))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ServerOptions"
    )
    for kw in call.keywords:
        out[(ServerOptions, kw.arg)] = getattr(from_config, kw.arg)
    return out


def test_engine_options_take_their_defaults_from_the_config():
    """Each engine option the config sets has one default, the config's: the options class neither
    disagrees with it (SyncOptions' canary tolerance once said 1e-4, the config 1e-3) nor restates it."""
    expected = engine_option_defaults()
    assert len({cls for cls, _ in expected}) == 3 and len(expected) > 20
    for (cls, name), want in expected.items():
        default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
        assert default == want, f"{cls.__name__}.{name}: default {default!r}, the config's {want!r}"
        expr = _class_defaults(cls)[name]
        assert not _literal(expr), f"{cls.__name__}.{name} restates its default: {ast.unparse(expr)}"
    from rljax.rollout.server import ServerOptions, options_from_config

    assert options_from_config(C.DEFAULTS) == ServerOptions()


def test_the_restated_default_finder():
    src = "class A:\n    x: int = 3\n    y: float = -1.5\n    z: tuple = ('a',)\n    w: int = D.a.b * 2\n"
    tree = ast.parse(src)
    values = {s.target.id: s.value for s in tree.body[0].body}
    assert [n for n, v in values.items() if _literal(v)] == ["x", "y", "z"]
