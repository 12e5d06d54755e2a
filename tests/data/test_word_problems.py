"""The word_problems source: deterministic, unique prompts, every solution step re-checked with Python's own
arithmetic, difficulty levels as documented, bad options named."""

import re
import statistics
from fractions import Fraction

import pytest

from rljax.data import SOURCES, make_source, split_train_eval
from rljax.data.word_problems import LEVELS, TEMPLATES

STEP_RE = re.compile(r"^(?P<what>[^:\d]+): (?P<expr>[\d+\-*/ ]+) = (?P<value>\d+)$")
# Numbers a solution may use without the prompt stating them: legs per animal, minutes per hour, percent.
WORLD_CONSTANTS = {2, 4, 6, 8, 60, 100}


def make(**options):
    return make_source("word_problems", **{"num_examples": 120, "seed": 0, **options})


def evaluate(expr: str) -> Fraction:
    """Python's precedence over exact fractions: independent of the generator's left-to-right steps."""
    exact = re.sub(r"\d+", lambda m: f"F({m.group()})", expr)
    return eval(exact, {"__builtins__": {}, "F": Fraction})  # noqa: S307 (digits, + - * / and spaces only)


def check_solution(example: dict) -> None:
    """Each step's arithmetic is right, its operands are stated in the prompt, computed by an earlier
    step or world constants, and the last step's value is the answer after "####"."""
    *steps, final = example["solution"].split("\n")
    stated = {int(x) for x in re.findall(r"\d+", example["prompt"])}
    computed: list[int] = []
    for line in steps:
        m = STEP_RE.match(line)
        assert m, f"unparsable step {line!r} in {example['template']}"
        value = int(m["value"])
        assert evaluate(m["expr"]) == value, line
        operands = {int(x) for x in re.findall(r"\d+", m["expr"])}
        assert operands <= stated | set(computed) | WORLD_CONSTANTS, (line, example["prompt"])
        computed.append(value)
    assert final == f"#### {example['answer']}" and example["answer"] == str(computed[-1])
    assert example["answer"].isdigit() and example["num_steps"] == len(steps)


def test_registry_lists_it_and_examples_have_the_fields():
    assert "word_problems" in SOURCES.names()
    example = make(num_examples=1)[0]
    assert {"prompt", "answer", "solution", "num_steps", "difficulty", "template"} <= set(example)
    assert isinstance(example["prompt"], str) and example["template"] in TEMPLATES
    assert len(TEMPLATES) >= 12


def test_deterministic_and_seeds_differ():
    a = make(seed=3, difficulty=3)
    assert a == make(seed=3, difficulty=3)
    b = make(seed=4, difficulty=3)
    assert len({e["prompt"] for e in a} & {e["prompt"] for e in b}) < 5


def test_golden_first_example():
    # Pins the stream: stdlib random is stable across Python versions, so a seed names one data set.
    first = make(num_examples=1, difficulty=1)[0]
    assert first["prompt"] == (
        "Each week Samuel earns $12 an hour for 5 hours of gardening. He spends $10 a week on bus fares "
        "and saves the rest. How many weeks does it take him to save $200?"
    )
    assert first["solution"] == (
        "Earned from gardening: 12 * 5 = 60\nSaved each week: 60 - 10 = 50\n"
        "Weeks needed: 200 / 50 = 4\n#### 4"
    )
    assert (first["answer"], first["num_steps"], first["template"]) == ("4", 3, "savings")


def test_prompts_unique_and_split_never_leaks():
    examples = make(num_examples=400, difficulty=1)
    prompts = [e["prompt"] for e in examples]
    assert len(set(prompts)) == len(prompts) == 400
    train, held_out = split_train_eval(examples, eval_size=50, seed=1)
    assert len(held_out) == 50 and len(train) == 350
    assert not {e["prompt"] for e in held_out} & {e["prompt"] for e in train}


@pytest.mark.parametrize("difficulty", sorted(LEVELS))
def test_every_solution_checks_out_and_every_template_fits_each_level(difficulty):
    examples = make(num_examples=300, seed=difficulty, difficulty=difficulty)
    level = LEVELS[difficulty]
    for example in examples:
        check_solution(example)
        assert level.min_steps <= example["num_steps"] <= level.max_steps
        assert example["difficulty"] == difficulty
    assert {e["template"] for e in examples} == set(TEMPLATES)


def test_levels_grow_steps_and_numbers():
    by_level = {d: make(num_examples=200, difficulty=d) for d in LEVELS}
    mean_steps = [statistics.mean(e["num_steps"] for e in by_level[d]) for d in sorted(LEVELS)]
    assert mean_steps == sorted(mean_steps) and len(set(mean_steps)) == len(mean_steps)
    largest = [
        statistics.median(max(map(int, re.findall(r"\d+", e["prompt"]))) for e in by_level[d])
        for d in sorted(LEVELS)
    ]
    assert largest == sorted(largest) and largest[0] < largest[-1]


def test_overrides_set_steps_and_number_sizes():
    five = make(difficulty=1, min_steps=5, max_steps=5)
    assert {e["num_steps"] for e in five} == {5} and all(e["difficulty"] == 1 for e in five)
    # Every number a `legs` story states is drawn (animal counts), so all are within max_value.
    legs = make(templates=("legs",), max_value=12, difficulty=4)
    assert {e["template"] for e in legs} == {"legs"}
    assert max(int(x) for e in legs for x in re.findall(r"\d+", e["prompt"])) <= 12
    # A percentage story starts from a stock of at most max_value.
    sales = make(templates=("percent_sales",), max_value=40)
    assert max(int(re.search(r"has (\d+)", e["prompt"])[1]) for e in sales) <= 40


@pytest.mark.parametrize(
    "options, name",
    [
        ({"difficulty": 0}, "difficulty"),
        ({"difficulty": "2"}, "difficulty"),
        ({"min_steps": 1}, "min_steps"),
        ({"max_steps": 9}, "max_steps"),
        ({"min_steps": 5, "max_steps": 4}, "min_steps"),
        ({"max_value": 5}, "max_value"),
        ({"max_value": 20.5}, "max_value"),
        ({"templates": ("ages", "nope")}, "templates"),
        ({"templates": ()}, "templates"),
        ({"num_examples": 0}, "num_examples"),
    ],
)
def test_bad_options_raise_naming_the_option(options, name):
    with pytest.raises(ValueError, match=f"option {name} must be"):
        make(**options)


def test_impossible_request_raises():
    # `legs` needs 3 steps at least (two kinds of animal, then the sum).
    with pytest.raises(ValueError, match="made only 0 distinct problems"):
        make(num_examples=3, templates=("legs",), min_steps=2, max_steps=2)
