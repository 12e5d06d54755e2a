"""vLLM engine crashes: the one rljax's CPU servers avoid (`prefill_args`), and the root cause of any
crash, read from the server's log (`crash_cause`).

vLLM's worker raises the real error; the engine core and the API server then log wrappers ("Worker failed
with error ...", "EngineCore encountered an issue. See stack trace (above)"). The recovery of
`rljax.rollout.engine` quotes the worker's line and compares it across restarts: the same line after a
restart is a deterministic crash, not retried.
"""

from __future__ import annotations

import re

_CPU_DEFAULT_BATCHED_TOKENS = 2048  # vLLM 0.32's max_num_batched_tokens for its CPU OpenAI server


def prefill_args(max_model_len: int, *, cpu_build: bool) -> list[str]:
    """vLLM flags that keep every prefill whole on the CPU build; none elsewhere.

    Why: vLLM samples a token for a partially prefilled request (chunked prefill: its prompt is larger
    than the step's token budget) and discards it, rewinding the request's seeded generator by its
    offset (`gpu_model_runner._bookkeeping_sync`, `gen.set_offset(gen.get_offset() - 4)`). CUDA's
    Philox generators have offsets; torch's CPU generator (mt19937) does not, so the CPU engine dies
    ("CPU Generator does not use offset") on the first seeded request whose prompt exceeds the budget.
    With chunked prefill off a prompt is scheduled whole or waits (vLLM's scheduler), no sample is
    discarded and no generator is rewound, for any batch shape; vLLM then needs a budget of at least
    `max_model_len` tokens (it refuses to start otherwise), as it sets itself where it turns chunked
    prefill off on CPU (MLA models, `platforms/cpu.py`). The budget stays vLLM's CPU server default
    (`_CPU_DEFAULT_BATCHED_TOKENS`) where that is enough.
    """
    if not cpu_build:
        return []
    budget = max(max_model_len, _CPU_DEFAULT_BATCHED_TOKENS)
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]


# A line of a Python exception ("RuntimeError: ..."), after vLLM's process and log prefixes.
_LOG_PREFIX_RE = re.compile(
    r"^(?:\(\w+ pid=\d+\)\s*)?(?:(?:ERROR|WARNING|INFO|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?"
)
_EXCEPTION_RE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Exit)): (.+)$")


def crash_cause(log_text: str) -> str | None:
    """The root-cause line of a crash in a server log: the first exception line after the first
    traceback (vLLM's worker raises it; the engine core and API server then re-raise wrappers that
    say "see stack trace above"), without vLLM's process/level/time prefix. None if there is none."""
    lines = log_text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    if start is None:
        return None
    for line in lines[start + 1 :]:
        match = _EXCEPTION_RE.match(_LOG_PREFIX_RE.sub("", line.strip()))
        if match:
            return f"{match.group(1)}: {match.group(2).strip()}"[:500]
    return None
