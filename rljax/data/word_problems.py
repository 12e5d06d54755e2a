"""GSM8K-style multi-step word problems with integer answers, generated offline from 12 story templates.

An example: "prompt" (the problem only), "answer" (a non-negative integer as a string), "solution" (one
step a line, "What: 3 * 12 = 36", then "#### 36"), "num_steps" (lines before "####"), "difficulty" and
"template" (a key of TEMPLATES). The answer is the last step's value, computed by the template's own
arithmetic in exact fractions; a draw giving a negative or fractional value is drawn again. Prompts are
unique within a set, so `split_train_eval` by prompt never leaks.

Difficulty: option `difficulty` (a key of LEVELS) sets three bounds; min_steps, max_steps and max_value
override them one by one.

    level  min_steps  max_steps  max_value
    1      2          3          20
    2      3          4          50
    3      4          6          100
    4      6          8          200

- A step is one solution line: one operation, a sum of several numbers, or a percentage "x * p / 100".
  Templates grow by parts (items bought, legs of a trip, people in an age chain, days of sales); a parts
  count whose steps fall outside [min_steps, max_steps] is redrawn. Steps: 2 to 8, as in GSM8K.
- max_value bounds every number a story draws (quantities, prices, speeds, pack sizes, pages a day, age
  gaps, minutes, the stock a percentage is taken of); most counts (people, trays, packs, hours, days
  read) come from [2, 9] at every level. Numbers derived and then stated (money handed over, a book's
  pages, a goal, items needed) may exceed it; ages stay below 100; percentages come from _PERCENTS.

References: GSM8K, Cobbe et al. 2021, arXiv:2110.14168; GSM-Symbolic, Mirzadeh et al. 2024, arXiv:2410.05229.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple

from rljax.data.sources import SOURCES, Example


class Level(NamedTuple):
    min_steps: int
    max_steps: int
    max_value: int


LEVELS = {1: Level(2, 3, 20), 2: Level(3, 4, 50), 3: Level(4, 6, 100), 4: Level(6, 8, 200)}
STEP_RANGE = (2, 8)
VALUE_RANGE = (10, 10_000)  # below 10 the small counts [2, 9] would break the max_value bound
_MAX_PARTS = 7
_MAX_AGE = 99
_TRIES = 40  # parts counts drawn per example before giving up on it (the fit rate is 1/7 at worst)
_PERCENTS = (10, 20, 25, 30, 40, 50, 60, 75, 80)
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_PRONOUNS = {"she": ("she", "her", "her"), "he": ("he", "him", "his")}
_NAMES = (
    ("Mia", "she"), ("Liam", "he"), ("Ava", "she"), ("Noah", "he"), ("Zoe", "she"), ("Omar", "he"),
    ("Priya", "she"), ("Kenji", "he"), ("Sofia", "she"), ("Mateo", "he"), ("Amara", "she"), ("Leo", "he"),
    ("Hana", "she"), ("Diego", "he"), ("Fatima", "she"), ("Ethan", "he"), ("Chloe", "she"), ("Ravi", "he"),
    ("Lucia", "she"), ("Samuel", "he"), ("Nora", "she"), ("Tariq", "he"), ("Elena", "she"), ("Jonas", "he"),
)  # fmt: skip
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
_GOODS = ("notebooks", "pens", "apples", "candles", "mugs", "scarves", "comic books", "plant pots")
_SMALL_THINGS = ("pencils", "marbles", "stickers", "trading cards", "beads", "stamps", "crayons")
_CONTAINERS = ("packs", "boxes", "bags", "jars", "tins", "cartons", "tubes")
_BAKED = ("cookies", "muffins", "cupcakes", "brownies", "rolls")
_GROUPS = ("friends", "classmates", "neighbors", "teammates", "cousins")
_SHOPS = (("bakery", "loaves"), ("florist", "roses"), ("farm stand", "melons"), ("toy shop", "kites"))
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_JOBS = ("babysitting", "tutoring", "dog walking", "gardening", "car washing", "delivering flyers")
_SPENDING = ("snacks", "bus fares", "games", "music lessons")
_ANIMALS = (("chickens", 2), ("cows", 4), ("spiders", 8), ("ducks", 2), ("beetles", 6), ("goats", 4))
_DISHES = ("pancakes", "muffins", "cookies", "dumplings", "waffles")
_INGREDIENTS = ("flour", "sugar", "milk", "oats", "water", "rice", "yogurt")
_ACTIVITIES = ("piano", "guitar", "chess", "swimming", "drawing", "soccer", "yoga")
_TIME_UNITS = ((15, 4), (20, 3), (30, 2), (10, 6), (12, 5), (60, 1))  # (m, d): m * d minutes is whole hours
_SUPPLIES = ("paper cups", "plates", "balloons", "napkins", "candles", "party hats", "forks")


class _Reject(Exception):
    """A draw gave a negative or fractional value; the example is drawn again."""


class _Story:
    """One problem under construction: draws its numbers and records its solution steps."""

    def __init__(self, rng: random.Random, max_value: int):
        self.rng, self.max_value = rng, max_value
        self.lines: list[str] = []
        self.value = 0  # the last step's value: the answer once the template returns

    def num(self, hi: int | None = None, lo: int = 2) -> int:
        """A drawn quantity in [lo, min(hi, max_value)]."""
        return self.rng.randint(lo, min(hi or self.max_value, self.max_value))

    def upto(self, lo: int, hi: int) -> int | None:
        return self.rng.randint(lo, hi) if lo <= hi else None

    def few(self) -> int:
        return self.rng.randint(2, 9)  # a count of people, packs, hours... whatever the level

    def pick(self, pool: tuple, n: int) -> list:
        return self.rng.sample(pool, min(n, len(pool)))

    def person(self) -> tuple[str, str, str, str]:
        """(name, subject, object, possessive pronoun)."""
        name, pronoun = self.rng.choice(_NAMES)
        return (name, *_PRONOUNS[pronoun])

    def calc(self, what: str, *terms: int | str) -> int:
        """Records the step "what: a op b ... = value" and returns value. The ops of one step are all
        additive or all multiplicative, so left-to-right evaluation is the usual precedence."""
        numbers, ops = terms[::2], terms[1::2]
        if not (set(ops) <= {"+", "-"} or set(ops) <= {"*", "/"}):
            raise ValueError(f"step {what!r} mixes + - with * /: {terms}")
        value = Fraction(numbers[0])
        for op, x in zip(ops, numbers[1:], strict=True):
            value = _OPS[op](value, x)
        if value.denominator != 1 or value < 0:
            raise _Reject
        self.lines.append(f"{what}: {' '.join(map(str, terms))} = {value}")
        self.value = int(value)
        return self.value

    def total(self, what: str, values: list[int]) -> int:
        """The sum of `values` as one step (no step for a single value)."""
        return values[0] if len(values) == 1 else self.calc(what, *_plus(values))


def _plus(values: list[int]) -> list[int | str]:
    return [t for v in values for t in ("+", v)][1:]


def _join(parts: list[str], last: str = " and ") -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + last + parts[-1]


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _products(s: _Story, rows: list[tuple], what: str) -> list[int]:
    """One step per row (label, a, b, ...): a * b, named what.format(label)."""
    return [s.calc(what.format(row[0]), row[1], "*", row[2]) for row in rows]


def _shopping(s: _Story, n: int) -> str:
    who, she, _, _ = s.person()
    rows = [(item, s.few(), s.num()) for item in s.pick(_GOODS, n)]
    spent = s.total("Total cost", _products(s, rows, "Cost of the {}"))
    paid = (spent // 10 + s.rng.randint(1, 3)) * 10
    s.calc("Change", paid, "-", spent)
    bought = _join([f"{q} {item} at ${p} each" for item, q, p in rows])
    return f"{who} buys {bought}. {_cap(she)} pays with ${paid}. How many dollars of change does {she} get?"


def _packs(s: _Story, n: int) -> str:
    who, she, _, her = s.person()
    unit, have, k = s.rng.choice(_SMALL_THINGS), s.num(), s.rng.choice((1, s.few()))
    rows = [(box, s.few(), s.num()) for box in s.pick(_CONTAINERS, n)]
    total = s.calc(f"{_cap(unit)} in all", *_plus([have, *_products(s, rows, f"{_cap(unit)} in the {{}}")]))
    each = s.upto(2, min(total // k, s.max_value))
    if each is None:
        raise _Reject
    given = each if k == 1 else s.calc(f"{_cap(unit)} given away", k, "*", each)
    gift = f"{each} {unit} to {her} brother" if k == 1 else f"{each} {unit} to each of {k} friends"
    s.calc(f"{_cap(unit)} left", total, "-", given)
    bought = _join([f"{y} {box} of {z} {unit}" for box, y, z in rows])
    story = f"{who} has {have} {unit}. {_cap(she)} buys {bought}. Then {she} gives {gift}."
    return f"{story} How many {unit} are left?"


def _trip(s: _Story, n: int) -> str:
    who, she, _, _ = s.person()
    legs = [(_ORDINALS[i], s.num(), s.few()) for i in range(n)]
    driven = s.total("Total distance", _products(s, legs, "Distance of the {} part"))
    plan = _join([f"at {v} km per hour for {h} hours" for _, v, h in legs], ", then ")
    if s.rng.random() < 0.5:
        return f"{who} drives {plan}. How many km does {she} drive in total?"
    trip = driven + s.num()
    s.calc("Distance left", trip, "-", driven)
    return f"{who} is on a {trip} km trip. {_cap(she)} drives {plan}. How many km of the trip are left?"


def _sharing(s: _Story, n: int) -> str:
    who, she, _, _ = s.person()
    food, group, k = s.rng.choice(_BAKED), s.rng.choice(_GROUPS), s.few()
    trays = [(_ORDINALS[i], s.few(), s.num()) for i in range(n)]
    made = _products(s, trays, f"{_cap(food)} in the {{}} batch")
    extra = -sum(made) % k  # bought so that the total shares evenly
    total = s.total(f"{_cap(food)} in all", made + ([extra] if extra else []))
    each = s.calc(f"{_cap(food)} for each", total, "/", k)
    text = f"{who} bakes {_join([f'{a} trays of {b} {food}' for _, a, b in trays])}"
    text += f" and buys {extra} more. " if extra else ". "
    text += f"{_cap(she)} shares all the {food} equally among {k} {group}."
    if each < 2 or s.rng.random() < 0.5:
        return text + f" How many {food} does each of them get?"
    eaten = s.rng.randint(1, min(each - 1, s.max_value))
    s.calc(f"{_cap(food)} each one keeps", each, "-", eaten)
    return text + f" Each of them eats {eaten}. How many {food} does each of them have left?"


# kind: (op, sentence, draw); draw(story, age): k for the previous age, None where the kind can't fit
_RELATIONS: dict[str, tuple[str, str, Callable[[_Story, int], int | None]]] = {
    "times": ("*", "{k} times as old as", lambda s, v: s.upto(2, min(5, _MAX_AGE // v))),
    "more": ("+", "{k} years older than", lambda s, v: s.upto(2, min(s.max_value, _MAX_AGE - v))),
    "less": ("-", "{k} years younger than", lambda s, v: s.upto(2, min(s.max_value, v - 1))),
    "half": ("/", "half as old as", lambda s, v: 2 if v % 2 == 0 else None),
}


def _ages(s: _Story, n: int) -> str:
    """A chain of n relations, each person's age from the one before (a step each), then a future age."""
    names = [name for name, _ in s.rng.sample(_NAMES, n + 1)]
    ages = [s.num(hi=40, lo=4)]
    text = f"{names[0]} is {ages[0]} years old."
    for ref, name in zip(names[:-1], names[1:], strict=True):
        k = None
        while k is None:
            op, sentence, draw = _RELATIONS[s.rng.choice(sorted(_RELATIONS))]
            k = draw(s, ages[-1])
        ages.append(s.calc(f"{name}'s age", ages[-1], op, k))
        text += f" {name} is {sentence.format(k=k)} {ref}."
    later = s.few()
    s.calc(f"{names[-1]}'s age then", ages[-1], "+", later)
    return f"{text} How old will {names[-1]} be in {later} years?"


def _percent_sales(s: _Story, n: int) -> str:
    (shop, item), days = s.rng.choice(_SHOPS), s.pick(_DAYS, n)
    percents = [s.rng.choice(_PERCENTS) for _ in days]
    share, unit = Fraction(1), 1  # unit: the least stock for which every day's sale is whole
    for p in percents:
        unit = math.lcm(unit, (share * p / 100).denominator)
        share -= share * p / 100
    if unit > s.max_value:
        raise _Reject
    stock = left = unit * s.rng.randint(1, s.max_value // unit)
    text = f"A {shop} has {stock} {item}."
    for i, (day, p) in enumerate(zip(days, percents, strict=True)):
        sold = s.calc(f"{_cap(item)} sold on {day}", left, "*", p, "/", 100)
        left = s.calc(f"{_cap(item)} left after {day}", left, "-", sold)
        text += f" On {day} it sells {p}% of {'them' if i == 0 else 'the rest'}."
    return f"{text} How many {item} are left after {days[-1]}?"


def _savings(s: _Story, n: int) -> str:
    who, she, him, _ = s.person()
    jobs = [(job, s.num(), s.few()) for job in s.pick(_JOBS, n)]
    income = s.total("Weekly earnings", _products(s, jobs, "Earned from {}"))
    spend = s.rng.randint(1, min(income - 1, s.max_value))
    saved = s.calc("Saved each week", income, "-", spend)
    goal = saved * s.few()
    s.calc("Weeks needed", goal, "/", saved)
    work = _join([f"${w} an hour for {h} hours of {job}" for job, w, h in jobs])
    spent = f"{_cap(she)} spends ${spend} a week on {s.rng.choice(_SPENDING)} and saves the rest."
    return f"Each week {who} earns {work}. {spent} How many weeks does it take {him} to save ${goal}?"


def _legs(s: _Story, n: int) -> str:
    who, _, _, _ = s.person()
    rows = [(animal, s.num(), legs) for animal, legs in s.pick(_ANIMALS, max(2, n))]
    s.total("Legs in all", _products(s, rows, "Legs of the {}"))
    seen = _join([f"{count} {animal}" for animal, count, _ in rows])
    return f"On a farm, {who} counts {seen}. How many legs do these animals have in total?"


def _reading(s: _Story, n: int) -> str:
    who, she, _, _ = s.person()
    rows = [(_ORDINALS[i], s.num(), s.few()) for i in range(n)]
    read = s.total("Pages read", _products(s, rows, "Pages read in the {} stretch"))
    pace = s.num()
    pages = read + pace * s.few()
    s.calc("Days to finish", s.calc("Pages left", pages, "-", read), "/", pace)
    plan = _join([f"{p} pages a day for {d} days" for _, p, d in rows], ", then ")
    ask = f"If {she} then reads {pace} pages a day, how many more days does {she} need to finish the book?"
    return f"A book has {pages} pages. {who} reads {plan}. {ask}"


def _recipe(s: _Story, n: int) -> str:
    who, she, _, _ = s.person()
    dish, serves = s.rng.choice(_DISHES), s.num()
    target = serves * s.few()
    batches = s.calc("Batches", target, "/", serves)
    rows = [(ingredient, s.num(), batches) for ingredient in s.pick(_INGREDIENTS, n)]
    s.total("Cups in all", _products(s, rows, "Cups of {}"))
    uses = _join([f"{c} cups of {ingredient}" for ingredient, c, _ in rows])
    what = rows[0][0] if len(rows) == 1 else "these ingredients"
    ask = f"{who} wants to make {target} {dish}. How many cups of {what} does {she} need in all?"
    return f"A recipe for {serves} {dish} uses {uses}. {ask}"


def _practice(s: _Story, n: int) -> str:
    who, she, _, _ = s.person()
    rows = []
    for activity in s.pick(_ACTIVITIES, n):
        m, d = s.rng.choice([u for u in _TIME_UNITS if u[0] <= s.max_value])
        days = max(2, d * s.rng.randint(1, s.max_value // d))
        rows.append((activity, m * s.rng.randint(1, s.max_value // m), days))
    minutes = s.total("Minutes in all", _products(s, rows, "Minutes of {}"))
    s.calc("Hours", minutes, "/", 60)
    plan = _join([f"{activity} for {m} minutes a day on {d} days" for activity, m, d in rows])
    return f"{who} practices {plan}. How many hours does {she} practice in total?"


def _bulk(s: _Story, n: int) -> str:
    who, she, _, _ = s.person()
    costs, needs, offers = [], [], []
    for item in s.pick(_SUPPLIES, n):
        size, price, packs = s.num(), s.num(), s.few()
        bought = s.calc(f"Packs of {item}", size * packs, "/", size)
        costs.append(s.calc(f"Cost of the {item}", bought, "*", price))
        needs.append(f"{size * packs} {item}")
        offers.append(f"{item} come in packs of {size} for ${price}")
    spent = s.total("Total cost", costs)
    text = f"{who} needs {_join(needs)} for a party. {_cap(_join(offers))}."
    if s.rng.random() < 0.5:
        return f"{text} How many dollars does {she} spend?"
    budget = spent + s.num()
    s.calc("Money left", budget, "-", spent)
    return f"{text} {_cap(she)} has ${budget}. How many dollars are left after buying them?"


TEMPLATES: dict[str, Callable[[_Story, int], str]] = {
    "shopping": _shopping, "packs": _packs, "trip": _trip, "sharing": _sharing, "ages": _ages,
    "percent_sales": _percent_sales, "savings": _savings, "legs": _legs, "reading": _reading,
    "recipe": _recipe, "practice": _practice, "bulk": _bulk,
}  # fmt: skip


def _make_example(rng: random.Random, template: str, level: Level, difficulty: int) -> Example | None:
    """One problem of `template` within the level's steps, or None when no parts count fit in _TRIES."""
    for _ in range(_TRIES):
        story = _Story(rng, level.max_value)
        try:
            prompt = TEMPLATES[template](story, rng.randint(1, _MAX_PARTS))
        except _Reject:
            continue
        if level.min_steps <= len(story.lines) <= level.max_steps:
            steps, answer = len(story.lines), str(story.value)
            solution = "\n".join([*story.lines, f"#### {answer}"])
            example = dict(prompt=prompt, answer=answer, solution=solution, num_steps=steps)
            return {**example, "difficulty": difficulty, "template": template}
    return None


def _check(name: str, value: object, valid: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"word_problems option {name} must be {valid}, got {value!r}")


def _in_range(value: object, bounds: tuple[int, int]) -> bool:
    return type(value) is int and bounds[0] <= value <= bounds[1]


def resolve_level(difficulty: int, **overrides: int | None) -> Level:
    """The bounds of level `difficulty` with the overrides that are not None (min_steps, max_steps,
    max_value) applied; bad options raise ValueError."""
    _check("difficulty", difficulty, f"one of {sorted(LEVELS)}", difficulty in LEVELS)
    level = LEVELS[difficulty]._replace(**{k: v for k, v in overrides.items() if v is not None})
    for name, bounds in (("min_steps", STEP_RANGE), ("max_steps", STEP_RANGE), ("max_value", VALUE_RANGE)):
        value = getattr(level, name)
        _check(name, value, f"an int in [{bounds[0]}, {bounds[1]}]", _in_range(value, bounds))
    _check("min_steps", level.min_steps, "<= max_steps", level.min_steps <= level.max_steps)
    return level


@SOURCES.register("word_problems")
def word_problems_source(
    *,
    num_examples: int = 1000,
    seed: int = 0,
    difficulty: int = 2,
    min_steps: int | None = None,
    max_steps: int | None = None,
    max_value: int | None = None,
    templates: tuple[str, ...] | None = None,
) -> list[Example]:
    """`num_examples` distinct GSM8K-style problems, deterministic given the options (fields and levels:
    the module docstring). `difficulty`: a key of LEVELS; min_steps, max_steps, max_value (None: the
    level's) override its bounds. `templates`: the story types drawn, uniformly (None: all of TEMPLATES).
    References: GSM8K (Cobbe et al. 2021, arXiv:2110.14168); GSM-Symbolic (arXiv:2410.05229)."""
    level = resolve_level(difficulty, min_steps=min_steps, max_steps=max_steps, max_value=max_value)
    names = list(TEMPLATES) if templates is None else list(templates)
    valid = f"a non-empty subset of {list(TEMPLATES)}"
    _check("templates", templates, valid, bool(names) and all(t in TEMPLATES for t in names))
    _check("num_examples", num_examples, "an int >= 1", _in_range(num_examples, (1, 10**9)))
    rng = random.Random(seed)
    examples, seen = [], set()
    for _ in range(10 * num_examples):  # room for duplicates and rare misses
        example = _make_example(rng, rng.choice(names), level, difficulty)
        if example is not None and example["prompt"] not in seen:
            seen.add(example["prompt"])
            examples.append(example)
            if len(examples) == num_examples:
                return examples
    raise ValueError(
        f"word_problems: made only {len(examples)} distinct problems of {num_examples} with {level}; "
        "ask for fewer, raise max_value or widen min_steps..max_steps"
    )
