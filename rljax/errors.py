"""One-line user errors, the same for every entry point: `fail(message)` prints `rljax: error: <message>`
on stderr and exits 2 (or `code`), no traceback. A leaf module (the stdlib only), so any entry point,
including the ones inside a library package (`rljax.models.fetch`), can use it without importing the rest
of start-up."""

from __future__ import annotations

import sys


def fail(message: str, code: int = 2) -> None:
    """A user error: one line `rljax: error: <message>` on stderr, exit `code` (2), no traceback."""
    print(f"rljax: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
