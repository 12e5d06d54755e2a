"""`python -m rljax.main` with faults wired in, for the loop fault suite (test_faults_loop.py).

RLJAX_TEST_FAULTS="kill_server_mid_generate:1,kill_server_mid_sync:2" wraps the run's rollout engine in a
`faults.FaultyEngine` with those server kills (tests/support/faults.py). RLJAX_TEST_POISON_UPDATE=N makes
the advantages of the N-th update's batch NaN inside the update (after the host-side batch validation,
which rejects non-finite inputs), so that step's loss and gradient are non-finite and the trainer's guard
must skip it.
Everything else is the unchanged entry point; no rljax module reads these variables.
"""

import dataclasses
import os

import faults
import jax.numpy as jnp

from rljax import trainer
from rljax.loop import setup

_make_update = trainer.make_family_update  # the loop builds its update through this
_make_engine = setup.make_engine  # and its engine and weights through this


def make_update(*args, **kwargs):
    update, calls = _make_update(*args, **kwargs), [0]
    poison = int(os.environ.get("RLJAX_TEST_POISON_UPDATE", "0"))

    def poisoned(state, batch, ref_params=None):
        calls[0] += 1
        if calls[0] == poison:
            batch = dataclasses.replace(batch, advantages=batch.advantages * jnp.nan)
        return update(state, batch, ref_params)

    return poisoned


def make_engine(*args, **kwargs):
    engine, weights = _make_engine(*args, **kwargs)
    return faults.FaultyEngine(engine, PLAN), weights


PLAN = faults.FaultPlan.parse(os.environ.get("RLJAX_TEST_FAULTS", ""))
trainer.make_family_update = make_update
setup.make_engine = make_engine

if __name__ == "__main__":
    from rljax.main import run

    run()
