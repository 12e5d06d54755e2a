"""The metric schema: required names, pattern lookup, the generated doc, and combine_metrics."""

import pathlib
import re

import numpy as np
import pytest

from rljax.metrics import SCHEMA, MetricSchema, MetricSpec, combine_metrics, example_names, lookup
from rljax.metrics import schema as schema_mod
from rljax.metrics.__main__ import main as schema_main

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# The names other parts of rljax (the loop, weight sync, rollout) write: they must stay in the table.
REQUIRED = """
reward/mean reward/std reward/<fn>/mean reward/frac_zero_std_groups response/length_mean response/length_max
response/clipped_ratio kl/mean entropy/mean loss/policy loss/kl loss/total clip/frac_low clip/frac_high
is/weight_mean is/weight_max is/frac_capped logprob/trainer_vs_rollout_abs_diff_mean
logprob/trainer_vs_rollout_abs_diff_max advantages/mean advantages/std optim/grad_norm optim/lr
optim/skipped_steps policy/version staleness/max staleness/mean staleness/hist weight_sync/seconds
weight_sync/bytes weight_sync/gb_per_s weight_sync/pause_seconds weight_sync/canary_logprob_max_abs_diff
weight_sync/canary_logprob_mean_abs_diff timing/<phase>_s timing/step_s throughput/rollout_tokens_per_s
throughput/update_tokens_per_s perf/mfu memory/host_rss_gb memory/device_peak_gb eval/accuracy
reward_fn/timeouts reward_fn/errors rollout/tokens_per_s rollout/policy_version compile/count
""".split()


def test_every_required_name_is_in_the_schema_with_unit_reduction_definition():
    assert MetricSchema is SCHEMA
    missing = [n for n in REQUIRED if n not in SCHEMA]
    assert not missing, missing
    for name in SCHEMA:
        spec = SCHEMA.get(name)
        assert spec.unit and spec.definition.endswith(".") and spec.reduction in schema_mod.REDUCTIONS, name


def test_lookup_exact_before_pattern_and_unknown_is_none():
    assert lookup("timing/step_s").name == "timing/step_s"  # exact beats the timing/<phase>_s pattern
    assert lookup("timing/weight_sync_s").name == "timing/<phase>_s"
    assert lookup("reward/math_verify/mean").name == "reward/<fn>/mean"
    assert lookup("reward/mean").name == "reward/mean"
    assert lookup("reward/frac_zero_std_groups").name == "reward/frac_zero_std_groups"
    # A placeholder is one path segment: no slashes, not empty, and the suffix must match.
    assert lookup("reward/a/b/mean") is None
    assert lookup("reward//mean") is None
    assert lookup("timing/rollout") is None
    assert lookup("not/a_metric") is None
    assert lookup("staleness/hist").kind == "histogram" and lookup("staleness/mean").kind == "scalar"


def test_example_names_resolve_to_their_own_spec():
    names = example_names()
    assert len(names) == len(SCHEMA) and "timing/phase_s" in names and "reward/fn/mean" in names
    for spec_name in SCHEMA:
        spec = SCHEMA.get(spec_name)
        assert lookup(spec.example()) is spec


def test_spec_validation_and_duplicate_names():
    with pytest.raises(ValueError, match="unknown reduction"):
        MetricSpec("x/y", "s", "median", "bad.")
    with pytest.raises(ValueError, match="one <placeholder>"):
        MetricSpec("x/<a>/<b>", "s", "mean", "bad.")
    with pytest.raises(ValueError, match="duplicate"):
        SCHEMA.add("reward/mean", SCHEMA.get("reward/mean"))


def test_doc_table_agrees_with_schema():
    text = DOC.read_text()
    assert schema_mod.table_in_doc(text) == schema_mod.render_table(), (
        "docs/metrics.md is out of date: run `python -m rljax.metrics --write docs/metrics.md`"
    )
    rows = [line for line in schema_mod.table_in_doc(text).splitlines()[2:]]
    documented = [row.split("`")[1] for row in rows]
    assert sorted(documented) == SCHEMA.names()
    # Four cells per row: any "|" inside a definition is escaped.
    assert all(len(re.split(r"(?<!\\)\|", row)) == 6 for row in rows)


def test_sync_doc_rewrites_a_stale_table(tmp_path, capsys):
    doc = tmp_path / "m.md"
    doc.write_text(f"intro\n{schema_mod.TABLE_BEGIN}\n| stale |\n{schema_mod.TABLE_END}\nouter\n")
    assert schema_main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert schema_mod.table_in_doc(text) == schema_mod.render_table()
    assert text.startswith("intro\n") and text.endswith("outer\n")
    assert schema_mod.sync_doc(doc) is False  # already current
    assert "updated" in capsys.readouterr().out
    with pytest.raises(ValueError, match="markers"):
        schema_mod.table_in_doc("no markers")


def test_combine_metrics_uses_each_reduction():
    parts = [
        {"loss/total": 1.0, "is/weight_max": 2.0, "optim/skipped_steps": 1, "optim/lr": 1e-3,
         "staleness/hist": [3, 1], "rollout/policy_version": 7, "custom/x": 1.0, "optim/nonfinite": 1.0},
        {"loss/total": np.float32(3.0), "is/weight_max": 5.0, "optim/skipped_steps": 0, "optim/lr": 5e-4,
         "staleness/hist": {0: 1, 2: 4}, "rollout/policy_version": 5, "optim/nonfinite": 0.0},
    ]  # fmt: skip
    out = combine_metrics(parts)
    assert out == {
        "loss/total": 2.0,  # mean
        "is/weight_max": 5.0,  # max
        "optim/skipped_steps": 0,  # last: the consecutive-skip counter after the last update
        "optim/nonfinite": 1.0,  # sum
        "optim/lr": 5e-4,  # last
        "staleness/hist": [4, 1, 4],  # counts added, padded
        "rollout/policy_version": 5,  # min
        "custom/x": 1.0,  # unknown: mean over the parts that have it
    }
    assert isinstance(out["optim/skipped_steps"], int)
