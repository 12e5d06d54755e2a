"""Evaluation switches: `trainer.eval_every` 0 or `data.eval_size` 0 turn eval off entirely."""

import pytest
from mp_trainer_common import with_fields

from rljax.config import Config
from rljax.loop import evaluation
from rljax.loop.inputs import resolve_examples


@pytest.mark.parametrize(
    "eval_every, eval_size, due",
    [
        (10, 64, [0, 10, 20, 25]),  # before step 1, every 10 versions, the last (steps=25)
        (0, 64, []),
        (10, 0, []),
        (1, 4, list(range(26))),
    ],
)
def test_eval_due(eval_every, eval_size, due):
    cfg = with_fields(Config(), trainer__eval_every=eval_every, data__eval_size=eval_size)
    cfg = with_fields(cfg, trainer__steps=25)
    assert [v for v in range(26) if evaluation.eval_due(cfg, v)] == due
    assert evaluation.eval_enabled(cfg) == bool(due)


def test_switched_off_evaluator_starts_no_verifier(monkeypatch):
    import rljax.rewards

    monkeypatch.setattr(rljax.rewards, "RewardPool", lambda *a, **k: pytest.fail("a verifier was started"))
    for fields in ({"trainer__eval_every": 0}, {"data__eval_size": 0}):
        # With evaluation off the sampler is never used: no prompt is encoded, nothing generated.
        evaluate = evaluation.make_evaluator(with_fields(Config(), **fields), None, [{"prompt": "1+1"}])
        assert evaluate is evaluation.NO_EVAL and evaluate() == {}
        evaluate.close()


def test_eval_size_zero_trains_on_every_prompt(monkeypatch):
    """The default job's data with `data.eval_size=0`: no prompt held out, the same train set otherwise."""
    monkeypatch.chdir(evaluation.__file__.rsplit("/rljax/", 1)[0])
    data = Config().data
    train, held_out = resolve_examples(data)
    all_train, none = resolve_examples(with_fields(Config(), data__eval_size=0).data)
    assert none == [] and len(held_out) == data.eval_size > 0
    assert len(all_train) > len(train) and all(e in all_train for e in train)
