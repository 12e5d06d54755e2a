"""A real multi-process run: 2 JAX processes x 4 CPU devices (jax.distributed on localhost) give the
same loss and gradients as one device (<= 1e-5 relative) and the same update (<= 1e-3 of its size)."""

import os

import mp_trainer_common as C
import pytest

WORKER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "mp_train_worker.py"
)
TIMEOUT_S = 400


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT_S + 200)
def test_two_processes_of_four_devices_match_one_device(tmp_path):
    ref = C.reference_run()
    in_path, out_path = str(tmp_path / "in.pkl"), str(tmp_path / "out.pkl")
    C.save_pickle({"ckpt": ref.ckpt, "batch": ref.batch}, in_path)
    C.run_two_processes(WORKER, [in_path, out_path], tmp_path, TIMEOUT_S)
    out = C.load_pickle(out_path)
    assert C.max_rel_diff(out["grads"], ref.grads) <= 1e-5
    assert C.max_step_rel_diff(out["new_params"], ref.new_params, ref.params) <= C.STEP_RTOL
    for key, value in out["metrics"].items():
        assert value == pytest.approx(ref.metrics[key], rel=1e-5, abs=1e-7), key
