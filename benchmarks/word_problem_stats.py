"""What each difficulty level of the `word_problems` source looks like, to choose a preset.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/word_problem_stats.py [--num-examples 1000] [--seed 0]

For each level of rljax.data.word_problems.LEVELS: its bounds, the mean and histogram of solution steps,
the answer range (min / median / max), the mean prompt length in words, the largest number a prompt
states (median), how many examples each template gave, and `--samples` problems with their worked
solutions. CPU only, about a second per level for 1000 examples.

References: GSM8K, Cobbe et al. 2021, arXiv:2110.14168; GSM-Symbolic, Mirzadeh et al. 2024,
arXiv:2410.05229.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics

from rljax.data import make_source
from rljax.data.word_problems import LEVELS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-examples", type=int, default=1000, help="examples generated per level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=3, help="sample problems printed per level")
    return ap.parse_args(argv)


def level_stats(examples: list[dict]) -> dict[str, object]:
    """Summary numbers of one level's examples."""
    answers = sorted(int(e["answer"]) for e in examples)
    largest = [max(int(x) for x in re.findall(r"\d+", e["prompt"])) for e in examples]
    return {
        "mean_steps": statistics.mean(e["num_steps"] for e in examples),
        "steps": dict(sorted(collections.Counter(e["num_steps"] for e in examples).items())),
        "answers": (answers[0], statistics.median(answers), answers[-1]),
        "mean_words": statistics.mean(len(e["prompt"].split()) for e in examples),
        "largest": statistics.median(largest),
        "templates": dict(sorted(collections.Counter(e["template"] for e in examples).items())),
    }


def print_level(difficulty: int, examples: list[dict], samples: int) -> None:
    stats = level_stats(examples)
    lo, mid, hi = stats["answers"]
    print(f"== difficulty {difficulty}: {LEVELS[difficulty]}")
    print(f"mean steps {stats['mean_steps']:.2f}  histogram {stats['steps']}")
    print(f"answers min {lo}  median {mid:g}  max {hi}")
    print(f"mean prompt words {stats['mean_words']:.1f}  median largest number stated {stats['largest']:g}")
    print(f"templates {stats['templates']}")
    for example in examples[:samples]:
        print(f"\n  [{example['template']}] {example['prompt']}")
        print("    " + example["solution"].replace("\n", "\n    "))
    print()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for difficulty in sorted(LEVELS):
        examples = make_source(
            "word_problems", num_examples=args.num_examples, seed=args.seed, difficulty=difficulty
        )
        print_level(difficulty, examples, args.samples)


if __name__ == "__main__":
    main()
