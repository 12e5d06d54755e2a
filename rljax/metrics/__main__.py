"""`python -m rljax.metrics [--write DOC]`: print the metric table, or rewrite it inside a doc."""

from __future__ import annotations

import argparse
import sys

from rljax.metrics.schema import render_table, sync_doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the metric table, or rewrite it inside a doc.")
    parser.add_argument("--write", metavar="DOC", help="rewrite the table between the markers of DOC")
    args = parser.parse_args(argv)
    if args.write:
        print("updated" if sync_doc(args.write) else "unchanged", args.write)
    else:
        sys.stdout.write(render_table() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
