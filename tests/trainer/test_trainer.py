"""GRPO-family train step: 1 vs 8 devices, micro-batching, the non-finite guard, bf16 vs fp32, update.

Every comparison runs the real decoder (tiny Qwen2 checkpoint) through rljax.kernels.token_logprobs.
The single-device reference run is built once per process (mp_trainer_common.reference_run).
"""

import jax
import mp_trainer_common as C
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from rljax import trainer
from rljax.trainer.step import make_grad_fn
from rljax.trainer.update import run_epochs


@pytest.fixture(scope="module")
def ref():
    return C.reference_run()


def fresh_state(ref, cfg=None, mesh=None):
    return trainer.init_train_state(cfg or ref.cfg, ref.model_config, ref.params, mesh or ref.mesh)


def test_reference_run_exercises_every_loss_term(ref):
    m = ref.metrics
    # The perturbed old/ref/behaviour log-probs must push ratios out of the clip range, IS weights over
    # the cap, and give non-zero KL and entropy terms; otherwise the equivalence tests prove little.
    for key in ("clip/frac_low", "clip/frac_high", "is/frac_capped", "kl/mean", "loss/kl"):
        assert m[key] > 0, key
    assert m["is/weight_max"] > ref.cfg.algo.is_cap
    assert m["loss/entropy"] < 0 and m["entropy/mean"] > 0
    np.testing.assert_allclose(
        m["loss/total"], m["loss/policy"] + m["loss/kl"] + m["loss/entropy"], rtol=1e-6
    )
    assert m["optim/nonfinite"] == 0 and m["optim/skipped_steps"] == 0
    assert m["optim/lr"] == pytest.approx(ref.cfg.optim.learning_rate)
    assert ref.grad_metrics["loss/total"] == pytest.approx(m["loss/total"], rel=1e-6)
    assert C.max_rel_diff(ref.new_params, ref.params) > 1e-4  # the step moved the params


def test_eight_devices_fsdp4_tensor2_match_one_device(ref):
    mesh = C.mesh_of(jax.devices(), 1, 4, 2)
    state = fresh_state(ref, mesh=mesh)
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(state.params)}
    assert any("fsdp" in str(s) for s in specs) and any("tensor" in str(s) for s in specs), specs
    inputs = trainer.shard_batch(ref.batch.inputs, mesh)
    logp, _ = trainer.make_logprob_fn(ref.cfg, ref.model_config, mesh)(state.params, inputs)
    mask = ref.batch.inputs.loss_mask
    np.testing.assert_allclose(np.asarray(logp) * mask, ref.logp * mask, rtol=1e-5, atol=1e-5)
    batch = trainer.shard_batch(ref.batch, mesh)
    grads, grad_metrics = make_grad_fn(ref.cfg, ref.model_config, mesh)(state.params, batch)
    assert C.max_rel_diff(grads, ref.grads) <= 1e-5
    new_state, metrics = trainer.make_train_step(ref.cfg, ref.model_config, mesh)(state, batch)
    for key, value in C.to_host(metrics).items():
        np.testing.assert_allclose(value, ref.metrics[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert C.max_step_rel_diff(new_state.params, ref.new_params, ref.params) <= C.STEP_RTOL
    assert (
        new_state.params["embed"]["embedding"].sharding.spec
        == state.params["embed"]["embedding"].sharding.spec
    )


def test_four_micro_batches_match_whole_batch(ref):
    cfg = C.with_fields(ref.cfg, trainer__micro_batch_size=C.ROWS // 4)
    state = fresh_state(ref, cfg)
    grads, metrics = make_grad_fn(cfg, ref.model_config, ref.mesh)(
        state.params, trainer.shard_batch(ref.batch, ref.mesh)
    )
    assert C.max_rel_diff(grads, ref.grads) <= 1e-6
    for key, value in C.to_host(metrics).items():
        np.testing.assert_allclose(value, ref.grad_metrics[key], rtol=1e-6, atol=1e-8, err_msg=key)


def test_micro_batches_are_strided_over_devices():
    from rljax.trainer.accumulate import split_micro_batches

    mesh = C.mesh_of(jax.devices(), 2, 2, 2)
    x = jax.device_put(np.arange(16), trainer.batch_sharding(mesh))
    micro = jax.jit(lambda a: split_micro_batches(a, 4, mesh))(x)
    np.testing.assert_array_equal(np.asarray(micro), np.arange(16).reshape(4, 4).T)
    assert micro.sharding.spec == PartitionSpec(None, ("data", "fsdp"))


def planted_nan(batch):
    adv = np.array(batch.advantages)
    adv[3] = np.nan  # one sequence's advantage: NaN loss, NaN gradient everywhere it reaches
    return batch.replace(advantages=adv)


def test_nonfinite_gradient_is_skipped_and_counter_resets(ref):
    state = fresh_state(ref)
    before = C.to_host((state.params, state.opt_state))
    state, metrics = ref.step(state, trainer.shard_batch(planted_nan(ref.batch), ref.mesh))
    assert float(metrics["optim/nonfinite"]) == 1.0 and float(metrics["optim/skipped_steps"]) == 1.0
    assert not np.isfinite(float(metrics["optim/grad_norm"]))
    after = C.to_host((state.params, state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # bitwise unchanged
    assert int(state.step) == 0 and int(state.nonfinite_count) == 1
    state, metrics = ref.step(state, trainer.shard_batch(ref.batch, ref.mesh))
    assert float(metrics["optim/nonfinite"]) == 0.0 and int(state.nonfinite_count) == 0
    assert int(state.step) == 1
    # The skipped step left no trace: the good step gives exactly the reference update.
    assert C.max_rel_diff(state.params, ref.new_params) <= 1e-6


def test_k_consecutive_nonfinite_steps_stop_the_run(ref):
    cfg = C.with_fields(ref.cfg, trainer__epochs=6, trainer__max_nonfinite_skips=3)
    calls = []

    def counting_step(state, batch):
        calls.append(1)
        return ref.step(state, batch)

    bad = trainer.shard_batch(planted_nan(ref.batch), ref.mesh)
    with pytest.raises(trainer.NonFiniteError, match="3 consecutive update steps.*max_nonfinite_skips=3"):
        run_epochs(cfg, ref.mesh, counting_step, fresh_state(ref), bad)
    assert len(calls) == 3


def test_update_runs_epochs_times_minibatches_steps(ref):
    cfg = C.with_fields(ref.cfg, trainer__epochs=2, trainer__minibatches=2)
    update = trainer.make_update(cfg, ref.model_config, ref.mesh)
    inputs = trainer.shard_batch(ref.batch.inputs, ref.mesh)
    ref_params = fresh_state(ref).params
    state, metrics = update(fresh_state(ref), inputs, ref_params)
    assert int(state.step) == 4 and metrics["optim/steps"] == 4 and metrics["optim/nonfinite"] == 0
    # The old log-probs are the trainer's own, so the mismatch metric is |logp - behaviour| on the mask.
    mask = ref.batch.inputs.loss_mask
    gap = np.abs(ref.logp - ref.batch.inputs.behavior_logp) * mask
    assert metrics["logprob/trainer_vs_rollout_abs_diff_max"] == pytest.approx(gap.max(), rel=1e-5)
    # First step of each epoch starts on-policy; later minibatches see the moved policy, so the
    # policy's KL to the reference (= the initial params) becomes positive.
    assert metrics["kl/mean"] > 0
    assert all(np.isfinite(v) for v in metrics.values())
    with pytest.raises(ValueError, match="needs ref_params"):
        update(state, inputs)


# bf16 compute vs float32 on the same batch for a few steps. Tolerance: bf16 has an 8-bit mantissa
# (relative rounding 2^-8 ~ 4e-3) and the decoder's residual stream is kept in bf16, so per-token
# log-probs differ by ~1e-2 absolute; the loss (a mean over ~300 tokens) tracks within 2e-2 absolute,
# and the parameters after the steps stay within 2% (norm-wise) of the float32 run.
BF16_LOSS_ATOL = 2e-2
BF16_PARAM_RTOL = 2e-2


def test_bf16_compute_tracks_float32(ref):
    cfg_bf16 = C.with_fields(ref.cfg, model__compute_dtype="bfloat16")
    step_bf16 = trainer.make_train_step(cfg_bf16, ref.model_config, ref.mesh)
    batch = trainer.shard_batch(ref.batch, ref.mesh)
    runs = {}
    for name, cfg, step in [("fp32", ref.cfg, ref.step), ("bf16", cfg_bf16, step_bf16)]:
        state, losses = fresh_state(ref, cfg), []
        for _ in range(4):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss/total"]))
        runs[name] = (np.array(losses), C.to_host(state.params))
        assert jax.tree.leaves(state.params)[0].dtype == np.float32  # master params stay float32
    (l32, p32), (l16, p16) = runs["fp32"], runs["bf16"]
    assert l32[-1] < l32[0]  # the fp32 run is learning on this batch, so tracking it means something
    np.testing.assert_allclose(l16, l32, atol=BF16_LOSS_ATOL)
    moved = C.max_rel_diff(p32, ref.params)
    assert C.max_rel_diff(p16, p32) <= BF16_PARAM_RTOL * max(moved, 1.0)
    assert C.max_rel_diff(p16, ref.params) > 0


# Dr. GRPO's constant normalizer is the generation budget, not the padded width. Four rows of
# (prompt, completion) lengths (3, 5), (2, 20), (4, 1), (5, 26) -- at most 31 positions, so they fit a
# 32-wide bucket -- with advantages 1, -0.5, 2, 0.25. On policy (old_logp = the trainer's own logp,
# ratio 1, no clipping; IS off) ppo_clip's per-token loss is -A_b, so
#   loss = -sum_b A_b * n_b / (B * max_tokens) = -(5 - 10 + 2 + 6.5) / (4 * 48) = -3.5/192
# at any padded width. The bucket width as normalizer would give -3.5/128 at 32 and -3.5/256 at 64.
DRGRPO_ROWS = [(3, 5), (2, 20), (4, 1), (5, 26)]
DRGRPO_ADV = [1.0, -0.5, 2.0, 0.25]
DRGRPO_MAX_TOKENS = 48


def drgrpo_inputs(width: int, vocab: int):
    """The same four rows padded (on the right, segment 0) to `width` positions."""
    rng = np.random.default_rng(5)
    base = C.loss_inputs(0, vocab, rows=len(DRGRPO_ROWS), length=width)
    z = lambda dt: np.zeros((len(DRGRPO_ROWS), width), dt)  # noqa: E731
    ids, tgt, pos, seg, mask = z(np.int32), z(np.int32), z(np.int32), z(np.int32), z(np.float32)
    for r, (prompt, completion) in enumerate(DRGRPO_ROWS):
        total = prompt + completion
        toks = rng.integers(3, vocab, size=total).astype(np.int32)
        ids[r, :total], seg[r, :total], pos[r, :total] = toks, 1, np.arange(total)
        tgt[r, : total - 1] = toks[1:]
        mask[r, prompt - 1 : total - 1] = 1.0
    return base.replace(
        input_ids=ids,
        target_ids=tgt,
        positions=pos,
        segment_ids=seg,
        loss_mask=mask,
        behavior_logp=z(np.float32),
        advantages=np.asarray(DRGRPO_ADV, np.float32),
    )


def test_drgrpo_loss_and_gradient_do_not_depend_on_the_padded_width(ref):
    cfg = C.with_fields(
        ref.cfg,
        algo__aggregation="seq_mean_token_sum_norm",
        algo__beta=0.0,
        algo__entropy_coef=0.0,
        algo__is_level="none",
        rollout__max_tokens=DRGRPO_MAX_TOKENS,
    )
    state = fresh_state(ref, cfg)
    runs = {}
    for width in (32, 64):
        inputs = trainer.shard_batch(drgrpo_inputs(width, ref.model_config.vocab_size), ref.mesh)
        logp, _ = trainer.make_logprob_fn(cfg, ref.model_config, ref.mesh)(state.params, inputs)
        batch = trainer.TrainBatch(inputs=inputs, old_logp=logp, advantages=inputs.advantages)
        grads, metrics = make_grad_fn(cfg, ref.model_config, ref.mesh)(state.params, batch)
        runs[width] = C.to_host((grads, metrics))
        np.testing.assert_allclose(runs[width][1]["loss/total"], -3.5 / 192, rtol=1e-6)
    (g32, m32), (g64, m64) = runs[32], runs[64]
    assert m32["clip/frac_low"] == m32["clip/frac_high"] == 0  # on policy: the hand value holds
    np.testing.assert_allclose(m64["loss/policy"], m32["loss/policy"], rtol=1e-6)
    # Same rows, same math; only the reduction lengths of the padded attention differ (float32 rounding).
    assert C.max_rel_diff(g64, g32) <= 1e-6
    assert max(np.abs(x).max() for x in jax.tree.leaves(g32)) > 1e-4  # a gradient to compare


def test_geometric_is_level_reaches_the_step(ref):
    # is/weight_* from the step against numpy: each row's weight is exp(mean over its loss tokens of the
    # clamped old - behaviour log-ratio), the same for all of the row's tokens.
    cfg = C.with_fields(ref.cfg, algo__is_level="geometric")
    _, metrics = make_grad_fn(cfg, ref.model_config, ref.mesh)(
        fresh_state(ref, cfg).params, trainer.shard_batch(ref.batch, ref.mesh)
    )
    mask = ref.batch.inputs.loss_mask
    log_ratio = np.clip((ref.batch.old_logp - ref.batch.inputs.behavior_logp) * mask, -20, 20)
    row_w = np.exp(log_ratio.sum(1) / mask.sum(1))
    np.testing.assert_allclose(float(metrics["is/weight_max"]), row_w.max(), rtol=1e-6)
    np.testing.assert_allclose(
        float(metrics["is/weight_mean"]), (row_w * mask.sum(1)).sum() / mask.sum(), rtol=1e-6
    )
    capped = (row_w > cfg.algo.is_cap) * mask.sum(1)
    np.testing.assert_allclose(float(metrics["is/frac_capped"]), capped.sum() / mask.sum(), rtol=1e-6)
    assert float(metrics["is/weight_max"]) < ref.metrics["is/weight_max"]  # a row mean is below its max


def test_an_updates_metrics_combine_by_the_metric_schema():
    """`summarize` (over an update's optimizer steps) and the host (over a step's parts) read one table."""
    from rljax.metrics.schema import lookup
    from rljax.trainer.update import summarize

    history = [
        {"loss/total": 1.0, "optim/skipped_steps": 1.0, "optim/nonfinite": 1.0, "is/weight_max": 3.0},
        {"loss/total": 3.0, "optim/skipped_steps": 0.0, "optim/nonfinite": 0.0, "is/weight_max": 2.0},
    ]
    out = summarize(history)
    assert out == {
        "loss/total": 2.0,
        "optim/skipped_steps": 0.0,  # the consecutive-skip counter after the last step
        "optim/nonfinite": 1.0,
        "is/weight_max": 3.0,
        "optim/steps": 2.0,
    }
    assert [lookup(k).reduction for k in ("optim/skipped_steps", "optim/nonfinite")] == ["last", "sum"]
