"""Shared prompts (`trainer.share_prompts`): the completions of one prompt store it once per packed row and
attend to it through the prompt's segment id. The plan, the segment encoding and the mask; the same
log-probs, loss, metrics and gradients as the unshared packed batch for every aggregation, on 1 and 8
devices micro-batched; the config and batch checks."""

import dataclasses

import jax
import jax.numpy as jnp
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import algos, trainer
from rljax.config import ConfigError, validate
from rljax.models import layers
from rljax.trainer import packing
from rljax.trainer.batch import TrainBatch
from rljax.trainer.logprobs import make_logprob_fn
from rljax.trainer.step import make_grad_fn
from rljax.types import BRANCH_SHIFT, BatchError, LossInputs, validate_loss_inputs

ROW_LEN = 64
GROUP = 4  # rows_loss_inputs numbers groups of 4 rows


def grouped_inputs(seed: int, vocab: int, rows: int = C.ROWS, length: int = C.LENGTH) -> LossInputs:
    """Rows in groups of GROUP that share a prompt (2-9 tokens); the last group's last row has its own
    prompt (a unit of one inside a shared batch)."""
    rng = np.random.default_rng(seed)
    sequences, prompts = [], []
    for r in range(rows):
        if r % GROUP == 0 or r == rows - 1:
            prompt = rng.integers(3, vocab, size=int(rng.integers(2, 10))).astype(np.int32)
        total = int(rng.integers(len(prompt) + 3, length + 1))
        completion = rng.integers(3, vocab, size=total - len(prompt)).astype(np.int32)
        sequences.append(np.concatenate([prompt, completion]))
        prompts.append(len(prompt))
    return C.rows_loss_inputs(sequences, prompts, rng, length)


@pytest.fixture(scope="module")
def ref():
    """(reference, TrainBatch of grouped rows with old/ref log-probs from the tiny model)."""
    ref = C.reference_run()
    inputs = grouped_inputs(3, ref.model_config.vocab_size)
    state = trainer.init_train_state(ref.cfg, ref.model_config, ref.params, ref.mesh)
    logp, _ = make_logprob_fn(ref.cfg, ref.model_config, ref.mesh)(
        state.params, trainer.shard_batch(inputs, ref.mesh)
    )
    return ref, C.off_policy_batch(inputs, np.asarray(logp), 0), np.asarray(logp)


def plan_of(inputs: LossInputs, shared: bool, data_parallel: int = 1) -> packing.PackingPlan:
    lengths = packing.sequence_lengths(inputs)
    units = None
    if shared:
        units = packing.shared_prompt_units(inputs.input_ids, inputs.loss_mask, lengths, ROW_LEN)
    return packing.plan_packing(
        lengths, row_len=ROW_LEN, num_ranks=data_parallel, rows_multiple=data_parallel, units=units
    )


def packed(batch: TrainBatch, plan: packing.PackingPlan) -> TrainBatch:
    inputs = packing.pack_loss_inputs(batch.inputs, plan)
    extra = packing.pack_token_arrays(
        {"old_logp": batch.old_logp, "ref_logp": batch.ref_logp}, batch.inputs.segment_ids, plan
    )
    return TrainBatch(
        inputs=inputs,
        old_logp=extra["old_logp"],
        advantages=inputs.advantages,
        **{"ref_logp": extra["ref_logp"]},
    )


def test_units_share_each_groups_prompt_and_split_at_the_row_length():
    inputs = grouped_inputs(0, 64)
    lengths = packing.sequence_lengths(inputs)
    units = packing.shared_prompt_units(inputs.input_ids, inputs.loss_mask, lengths, ROW_LEN)
    members = sorted(b for u in units for b in u.members)
    assert members == list(range(C.ROWS))  # every row once
    first_loss = np.argmax(inputs.loss_mask > 0, axis=1)
    for u in units:
        assert u.length(lengths) <= ROW_LEN
        if u.prompt:
            assert len(u.members) > 1 and {b // GROUP for b in u.members} == {u.members[0] // GROUP}
            assert all(first_loss[b] == u.prompt for b in u.members)  # the prompt minus its last token
    last = [u for u in units if C.ROWS - 1 in u.members]
    assert last == [packing.Unit((C.ROWS - 1,))]  # its own prompt: a plain sequence
    tight = packing.shared_prompt_units(inputs.input_ids, inputs.loss_mask, lengths, int(lengths.max()) + 1)
    assert len(tight) > len(units)  # a group that does not fit one row splits, each part with its prompt
    assert all(u.length(lengths) <= int(lengths.max()) + 1 for u in tight)


def test_a_unit_never_holds_more_completions_than_the_segment_ids_can_number(monkeypatch):
    monkeypatch.setattr(packing, "MAX_BRANCHES", 2)
    inputs = grouped_inputs(0, 64)
    lengths = packing.sequence_lengths(inputs)
    units = packing.shared_prompt_units(inputs.input_ids, inputs.loss_mask, lengths, ROW_LEN)
    assert max(len(u.members) for u in units) == 2


def test_packed_rows_hold_each_prompt_once_with_branch_segments_and_original_positions():
    inputs = grouped_inputs(0, 64)
    plan = plan_of(inputs, shared=True)
    out = packing.pack_loss_inputs(inputs, plan)
    lengths = packing.sequence_lengths(inputs)
    saved = sum(plan.skip)
    assert saved > 0 and (out.segment_ids > 0).sum() == lengths.sum() - saved
    for r, members in enumerate(plan.rows):
        seg, pos, ids = out.segment_ids[r], out.positions[r], out.input_ids[r]
        offset = 0
        for b in members:
            n = int(lengths[b]) - plan.skip[b]
            own = seg[offset : offset + n]
            if plan.shared[b] and not plan.skip[b]:  # the unit's first member: prompt, then its branch
                prompt = own[: plan.shared[b]]
                assert len(set(prompt)) == 1 and prompt[0] < 1 << BRANCH_SHIFT
                assert (own[plan.shared[b] :] == (prompt[0] | 1 << BRANCH_SHIFT)).all()
            elif plan.shared[b]:
                assert len(set(own)) == 1 and own[0] >> BRANCH_SHIFT > 1
            np.testing.assert_array_equal(pos[offset : offset + n], np.arange(plan.skip[b], lengths[b]))
            np.testing.assert_array_equal(
                ids[offset : offset + n], inputs.input_ids[b, plan.skip[b] : lengths[b]]
            )
            offset += n


def test_attention_mask_sees_own_segment_and_the_prompt_it_continues():
    p = 3
    b1, b2 = p | 1 << BRANCH_SHIFT, p | 2 << BRANCH_SHIFT
    seg = jnp.asarray([[p, p, b1, b1, b2, b2, 4, 0]], jnp.int32)
    slots = jnp.arange(8, dtype=jnp.int32)
    mask = np.asarray(layers.attention_mask(slots, slots, seg, seg))[0]
    sees = {t: list(np.flatnonzero(mask[t])) for t in range(8)}
    assert sees == {
        0: [0],
        1: [0, 1],
        2: [0, 1, 2],
        3: [0, 1, 2, 3],
        4: [0, 1, 4],
        5: [0, 1, 4, 5],
        6: [6],
        7: [7],
    }


def test_batch_check_accepts_shared_prompts_and_still_refuses_an_empty_sequence():
    inputs = grouped_inputs(0, 64)
    out = packing.pack_loss_inputs(inputs, plan_of(inputs, shared=True))  # validated inside
    seg = out.segment_ids.copy()
    r, t = np.argwhere((seg > 0) & (seg < 1 << BRANCH_SHIFT) & (out.loss_mask == 0))[0]
    lone = seg.max() + 1  # not continued by anything: a sequence with no loss tokens
    seg[r, t] = lone
    with pytest.raises(BatchError, match="no loss tokens"):
        validate_loss_inputs(dataclasses.replace(out, segment_ids=seg))


def grads_metrics_logp(cfg, ref, batch, mesh):
    state = trainer.init_train_state(cfg, ref.model_config, ref.params, mesh)
    sharded = trainer.shard_batch(batch, mesh)
    grads, metrics = make_grad_fn(cfg, ref.model_config, mesh)(state.params, sharded)
    logp, _ = make_logprob_fn(cfg, ref.model_config, mesh)(state.params, sharded.inputs)
    return C.to_host(grads), C.to_host(metrics), np.asarray(logp)


def test_logprobs_equal_the_unshared_rows(ref):
    reference, batch, logp = ref
    plan = plan_of(batch.inputs, shared=True)
    shared = packed(batch, plan)
    cfg = C.with_fields(reference.cfg, trainer__tokens_per_micro_batch=ROW_LEN, trainer__share_prompts=True)
    _, _, got = grads_metrics_logp(cfg, reference, shared, reference.mesh)
    want = packing.pack_token_arrays({"logp": logp}, batch.inputs.segment_ids, plan)["logp"]
    on = shared.inputs.loss_mask > 0
    np.testing.assert_allclose(got[on], want[on], rtol=1e-5, atol=2e-6)


CASES = [{"algo__aggregation": name} for name in algos.LOSS_AGGREGATIONS.names()] + [
    {"algo__is_level": "sequence", "algo__aggregation": "seq_mean_token_mean"},
    {"algo__policy_loss": "gspo", "algo__clip_low": 3e-4, "algo__clip_high": 4e-4},
]


@pytest.mark.parametrize("changes", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_shared_equals_unshared(ref, changes):
    reference, batch, _ = ref
    mesh = C.mesh_of(jax.devices(), 1, 1, 1)
    cfg = C.with_fields(reference.cfg, trainer__tokens_per_micro_batch=ROW_LEN, **changes)
    g_u, m_u, _ = grads_metrics_logp(cfg, reference, packed(batch, plan_of(batch.inputs, False)), mesh)
    shared_cfg = C.with_fields(cfg, trainer__share_prompts=True)
    g_s, m_s, _ = grads_metrics_logp(shared_cfg, reference, packed(batch, plan_of(batch.inputs, True)), mesh)
    for key, value in m_u.items():
        np.testing.assert_allclose(m_s[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    assert C.max_rel_diff(g_s, g_u) <= 1e-5  # prompt gradients summed once instead of per copy


def test_shared_on_eight_devices_micro_batched_equals_unshared(ref):
    reference, batch, _ = ref
    cfg = C.with_fields(
        reference.cfg, trainer__tokens_per_micro_batch=ROW_LEN, algo__aggregation="seq_mean_token_mean"
    )
    g_u, m_u, _ = grads_metrics_logp(
        cfg, reference, packed(batch, plan_of(batch.inputs, False)), C.mesh_of(jax.devices(), 1, 1, 1)
    )
    shared_cfg = C.with_fields(cfg, trainer__share_prompts=True)
    shared = packed(batch, plan_of(batch.inputs, True, data_parallel=8))
    assert shared.inputs.input_ids.shape[0] % 8 == 0
    g_s, m_s, _ = grads_metrics_logp(shared_cfg, reference, shared, C.mesh_of(jax.devices(), 1, 8, 1))
    np.testing.assert_allclose(m_s["loss/total"], m_u["loss/total"], rtol=1e-5)
    assert C.max_rel_diff(g_s, g_u) <= 1e-5


def test_prepare_batch_shares_and_reports_the_saving(ref):
    reference, batch, _ = ref
    cfg = C.with_fields(reference.cfg, trainer__tokens_per_micro_batch=ROW_LEN, trainer__share_prompts=True)
    laid_out, metrics = trainer.layout_batch(cfg, batch.inputs, 1)
    real = packing.sequence_lengths(batch.inputs).sum()
    kept = (laid_out.segment_ids > 0).sum()
    assert kept < real and metrics["batch/shared_prompt_fraction"] == pytest.approx(1 - kept / real)
    _, off = trainer.layout_batch(C.with_fields(cfg, trainer__share_prompts=False), batch.inputs, 1)
    assert off["batch/shared_prompt_fraction"] == 0.0


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"trainer__share_prompts": True}, "trainer.share_prompts"),  # without packing
        (
            {
                "trainer__share_prompts": True,
                "trainer__tokens_per_micro_batch": 256,
                "model__attention_impl": "splash",
            },
            "model.attention_impl",
        ),
        (
            {
                "trainer__share_prompts": True,
                "trainer__tokens_per_micro_batch": 256,
                "model__family": "examples.fused_qwen:FusedQwen2",  # brings its own attention
            },
            "trainer.share_prompts",
        ),
    ],
)
def test_config_refuses_what_cannot_see_a_shared_prompt(changes, field):
    with pytest.raises(ConfigError) as e:
        validate(C.with_fields(C.base_config(), **changes))
    assert e.value.field == field


def test_every_attention_but_splash_applies_the_shared_prompt_mask():
    from rljax.models.attention import ATTENTION_IMPLS, sees_shared_prompts

    assert {n for n in ATTENTION_IMPLS.names() if not sees_shared_prompts(n)} == {"splash"}
