"""Data: file sources with field mappings, procedural tasks, train/eval split, iterator, templates."""

import itertools
import json

import numpy as np
import pytest

from rljax.data import (
    SOURCES,
    PromptIterator,
    epoch_permutation,
    format_prompt,
    make_source,
    split_train_eval,
)
from rljax.rewards import REWARDS

RECORDS = [
    {"question": "1 + 1 =", "final": 2, "meta": {"level": "easy"}},
    {"question": "2 * 3 =", "final": 6, "meta": {"level": "easy"}},
    {"question": "9 * 9 =", "final": 81, "meta": {"level": "hard"}},
]
FIELDS = {"prompt": "question", "answer": "final", "level": "meta.level"}


def check_mapped(examples):
    assert [e["prompt"] for e in examples] == ["1 + 1 =", "2 * 3 =", "9 * 9 ="]
    assert [e["answer"] for e in examples] == ["2", "6", "81"]  # answers become strings
    assert [e["level"] for e in examples] == ["easy", "easy", "hard"]  # dotted name reads nested fields
    assert examples[0]["question"] == "1 + 1 ="  # the record's own fields are kept


def test_registry_lists_the_sources():
    assert {"jsonl", "parquet", "hf_datasets", "arithmetic", "countdown"} <= set(SOURCES.names())
    with pytest.raises(KeyError, match="valid names"):
        make_source("jsonll")


def test_jsonl_with_field_mapping_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    check_mapped(make_source("jsonl", path=str(path), fields=FIELDS))
    assert len(make_source("jsonl", path=str(path), fields=FIELDS, limit=2)) == 2
    with pytest.raises(KeyError, match=r"record 0: missing \['prompt', 'answer'\].*question"):
        make_source("jsonl", path=str(path))
    with pytest.raises(KeyError, match="field 'nope'"):
        make_source("jsonl", path=str(path), fields={"prompt": "nope", "answer": "final"})
    no_answer = make_source("jsonl", path=str(path), fields={"prompt": "question"}, require_answer=False)
    assert [e["answer"] for e in no_answer] == ["", "", ""]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: invalid JSON"):
        make_source("jsonl", path=str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError):
        make_source("jsonl", path=str(tmp_path / "missing.jsonl"))


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")  # optional dependency (pip install pyarrow)
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "d.parquet")
    check_mapped(make_source("parquet", path=str(tmp_path / "d.parquet"), fields=FIELDS))


def test_hf_datasets_source(tmp_path):
    datasets = pytest.importorskip("datasets")  # optional dependency (pip install datasets)
    table = datasets.Dataset.from_list(RECORDS)
    table.save_to_disk(str(tmp_path / "single"))
    check_mapped(make_source("hf_datasets", path=str(tmp_path / "single"), fields=FIELDS))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "dict"))
    check_mapped(make_source("hf_datasets", path=str(tmp_path / "dict"), split="train", fields=FIELDS))
    with pytest.raises(KeyError, match=r"split= one of \['train'\]"):
        make_source("hf_datasets", path=str(tmp_path / "dict"), fields=FIELDS)


def test_arithmetic_is_deterministic_correct_and_tunable():
    a = make_source("arithmetic", num_examples=200, seed=3)
    assert a == make_source("arithmetic", num_examples=200, seed=3)
    assert a != make_source("arithmetic", num_examples=200, seed=4)
    for e in a:
        left, op, right = e["expr"].split()
        assert int(e["answer"]) == (int(left) + int(right) if op == "+" else int(left) * int(right))
        assert e["prompt"] == f"{e['expr']} =" and 0 <= int(left) <= 9
    knobs = dict(ops=("-",), min_value=10, max_value=99, num_terms=3)
    hard = make_source("arithmetic", num_examples=50, seed=0, **knobs)
    assert all(len(e["expr"].split()) == 5 and "-" in e["expr"] for e in hard)
    assert all(int(e["answer"]) == eval(e["expr"]) for e in hard)
    with pytest.raises(ValueError, match="subset"):
        make_source("arithmetic", ops=("/",))


def test_arithmetic_golden_first_example():
    # Golden values for seed 0 (stdlib random is stable across Python versions): pins determinism.
    first = make_source("arithmetic", num_examples=1, seed=0)[0]
    assert (first["expr"], first["answer"]) == ("6 + 6", "12")


def test_countdown_puzzles_are_solvable_and_the_reward_agrees():
    puzzles = make_source("countdown", num_examples=100, seed=1, num_numbers=4, max_target=200)
    assert puzzles == make_source("countdown", num_examples=100, seed=1, num_numbers=4, max_target=200)
    reward = REWARDS.get("countdown")
    for p in puzzles:
        assert 1 <= p["target"] <= 200 and len(p["numbers"]) == 4 and p["answer"] == str(p["target"])
        assert reward(prompt=p["prompt"], completion=f"<answer>{p['solution']}</answer>", example=p) == 1.0
        assert str(p["target"]) in p["prompt"] and all(str(n) in p["prompt"] for n in p["numbers"])
    wrong = {**puzzles[0], "target": puzzles[0]["target"] + 1}
    assert reward(prompt="", completion=f"<answer>{puzzles[0]['solution']}</answer>", example=wrong) == 0.0


def test_split_never_leaks_eval_prompts_into_train():
    examples = make_source("arithmetic", num_examples=500, seed=0)  # 200 distinct prompts: many duplicates
    train, held_out = split_train_eval(examples, eval_size=40, seed=7)
    eval_prompts = {e["prompt"] for e in held_out}
    assert len(held_out) == 40 and len(eval_prompts) == 40
    assert not eval_prompts & {e["prompt"] for e in train}
    assert len(train) + sum(e["prompt"] in eval_prompts for e in examples) == len(examples)
    assert split_train_eval(examples, eval_size=40, seed=7) == (train, held_out)
    with pytest.raises(ValueError, match="distinct prompts"):
        split_train_eval(examples[:3], eval_size=3)


def test_epoch_permutation_golden_and_properties():
    p0, p1 = epoch_permutation(10, seed=5, epoch=0), epoch_permutation(10, seed=5, epoch=1)
    assert sorted(p0) == list(range(10)) and sorted(p1) == list(range(10)) and list(p0) != list(p1)
    np.testing.assert_array_equal(p0, epoch_permutation(10, seed=5, epoch=0))
    np.testing.assert_array_equal(epoch_permutation(4, 0, 3, shuffle=False), np.arange(4))


def test_iterator_covers_each_epoch_once_with_full_batches():
    examples = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    it = PromptIterator(examples, batch_size=4, seed=1)
    batches = [next(it) for _ in range(5)]  # 20 items = 2 epochs, one batch straddles the boundary
    flat = [e["prompt"] for b in batches for e in b]
    assert all(len(b) == 4 for b in batches)
    expected = [str(i) for e in (0, 1) for i in epoch_permutation(10, 1, e)]
    assert flat == expected
    assert it.state() == {"epoch": 1, "index": 10, "seed": 1, "num_examples": 10}
    plain = PromptIterator(examples, batch_size=3, shuffle=False)
    assert [e["prompt"] for e in next(plain)] == ["0", "1", "2"]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 7])
def test_save_restore_mid_epoch_matches_uninterrupted(stop_after):
    examples = make_source("arithmetic", num_examples=23, seed=2)
    reference = PromptIterator(examples, batch_size=5, seed=9)
    expected = [next(reference) for _ in range(stop_after + 6)]
    it = PromptIterator(examples, batch_size=5, seed=9)
    for _ in range(stop_after):
        next(it)
    state = json.loads(json.dumps(it.state()))  # what a checkpoint round trip gives back
    assert all(isinstance(v, int) for v in state.values())
    resumed = PromptIterator.from_state(examples, state, batch_size=5)
    assert list(itertools.islice(resumed, 6)) == expected[stop_after:]
    other = PromptIterator(examples, batch_size=5, seed=9)
    other.restore(state)
    assert next(other) == expected[stop_after]


def test_restore_rejects_a_state_of_another_run():
    examples = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    it = PromptIterator(examples, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="seed"):
        it.restore({"epoch": 0, "index": 0, "seed": 1, "num_examples": 2})
    with pytest.raises(ValueError, match="3 examples"):
        it.restore({"epoch": 0, "index": 0, "seed": 0, "num_examples": 3})
    with pytest.raises(ValueError, match="out of range"):
        it.restore({"epoch": 0, "index": 5, "seed": 0, "num_examples": 2})


def test_format_prompt():
    example = {"prompt": "2 + 2 =", "answer": "4", "level": 1}
    assert format_prompt(example, "Question: {prompt}\nAnswer:") == "Question: 2 + 2 =\nAnswer:"
    assert format_prompt(example, r"{prompt} Put it in \boxed{{}} (level {level})") == (
        r"2 + 2 = Put it in \boxed{} (level 1)"
    )
    with pytest.raises(KeyError, match="needs field 'question'"):
        format_prompt(example, "{question}")
    with pytest.raises(ValueError, match="positional"):
        format_prompt(example, r"\boxed{}")


def test_split_with_eval_size_zero_holds_nothing_out():
    examples = make_source("arithmetic", num_examples=50, seed=0)
    assert split_train_eval(examples, eval_size=0, seed=7) == (examples, [])
