"""`python -m rljax.monitor WORKDIR`: a live table of every process's status file; flags stalled ones.

    python -m rljax.monitor WORKDIR [--stall-after S] [--interval S] [--once] [--prometheus-port PORT]

`--once` prints the table once and exits 1 if any process is stalled (2 if there is no status file): usable
from cron or a Slurm health check. `--prometheus-port` also serves the Prometheus text format at
http://127.0.0.1:PORT/metrics (loopback only) while the live view runs.
"""

from __future__ import annotations

import argparse
import http.server
import json
import math
import pathlib
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from rljax.metrics.console import format_duration
from rljax.metrics.logger import METRICS_FILE
from rljax.metrics.status import is_stalled, read_statuses

DEFAULT_STALL_AFTER_S = 600.0
_COLUMNS = ("proc", "host", "pid", "step", "phase", "policy", "heartbeat", "eta", "state")


def process_state(status: dict[str, Any], now: float, stall_after_s: float) -> str:
    """ "STALLED", "done"/"failed" (finished processes), or "ok"."""
    if is_stalled(status, now, stall_after_s):
        return "STALLED"
    return status["phase"] if status.get("phase") in ("done", "failed") else "ok"


def _row(status: dict[str, Any], now: float, stall_after_s: float) -> list[str]:
    step, total = status.get("step"), status.get("total_steps")
    step_text = "-" if step is None else (f"{step}/{total}" if total else str(step))
    return [
        str(status.get("process_index", "?")),
        str(status.get("host", "?")),
        str(status.get("pid", "?")),
        step_text,
        str(status.get("phase") or "-"),
        "-" if status.get("policy_version") is None else str(status["policy_version"]),
        format_duration(now - float(status["heartbeat"])) + " ago",
        format_duration(status.get("eta_s")),
        process_state(status, now, stall_after_s),
    ]


def format_table(statuses: Sequence[dict[str, Any]], now: float, stall_after_s: float) -> str:
    """A plain-text table of the processes, one row each, plus a summary line."""
    rows = [list(_COLUMNS)] + [_row(s, now, stall_after_s) for s in statuses]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    stalled = [s for s in statuses if is_stalled(s, now, stall_after_s)]
    summary = f"{len(statuses)} processes, {len(stalled)} stalled (heartbeat older than {stall_after_s:g} s)"
    return "\n".join([*lines, summary])


def last_metrics(workdir: str | pathlib.Path, tail_bytes: int = 1 << 16) -> dict[str, float]:
    """The numeric scalars of the last complete line of `workdir/metrics.jsonl` ({} if none)."""
    path = pathlib.Path(workdir) / METRICS_FILE
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - tail_bytes, 0))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            return {
                k: float(v) for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
    return {}


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(workdir: str | pathlib.Path, now: float, stall_after_s: float) -> str:
    """Prometheus text exposition (format 0.0.4) of the processes' status and the last step's metrics."""
    statuses = read_statuses(workdir)
    gauges = {
        "rljax_step": ("Last step reported by the process.", lambda s: s.get("step")),
        "rljax_policy_version": ("Policy version of the process.", lambda s: s.get("policy_version")),
        "rljax_heartbeat_age_seconds": ("Seconds since the last heartbeat.", lambda s: now - s["heartbeat"]),
        "rljax_eta_seconds": ("Estimated seconds to the end of the run.", lambda s: s.get("eta_s")),
        "rljax_stalled": ("1 if the heartbeat is older than the threshold.",
                          lambda s: int(is_stalled(s, now, stall_after_s))),
    }  # fmt: skip
    out = []
    for name, (help_text, get) in gauges.items():
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for s in statuses:
            value = get(s)
            if value is not None:
                out.append(f'{name}{{process="{_label(s.get("process_index"))}"}} {float(value):.6g}')
    out += [
        "# HELP rljax_metric Last step's value of each scalar in metrics.jsonl.",
        "# TYPE rljax_metric gauge",
    ]
    for key, value in sorted(last_metrics(workdir).items()):
        if key != "time" and math.isfinite(value):
            out.append(f'rljax_metric{{name="{_label(key)}"}} {value:.10g}')
    return "\n".join(out) + "\n"


def start_prometheus_server(
    workdir: str | pathlib.Path, port: int, stall_after_s: float = DEFAULT_STALL_AFTER_S
) -> http.server.ThreadingHTTPServer:
    """Serves GET /metrics on 127.0.0.1:`port` (0 picks a free port) from a daemon thread.

    The bound port is `server.server_address[1]`; stop it with `server.shutdown(); server.server_close()`.
    """

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = render_prometheus(workdir, time.time(), stall_after_s).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep the live view clean
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="rljax-prometheus", daemon=True).start()
    return server


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rljax.monitor", description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=pathlib.Path)
    p.add_argument("--stall-after", type=float, default=DEFAULT_STALL_AFTER_S, help="seconds (default 600)")
    p.add_argument("--interval", type=float, default=2.0, help="refresh period of the live view, seconds")
    p.add_argument("--once", action="store_true", help="print once; exit 1 if any process is stalled")
    p.add_argument("--prometheus-port", type=int, default=None, help="serve /metrics on 127.0.0.1:PORT")
    return p.parse_args(argv)


def check_once(workdir: pathlib.Path, stall_after_s: float) -> int:
    """Prints the table once; returns 0 if all fine, 1 if any process is stalled, 2 if none reported."""
    statuses = read_statuses(workdir)
    if not statuses:
        print(f"no status files under {workdir / 'status'}", file=sys.stderr)
        return 2
    now = time.time()
    print(format_table(statuses, now, stall_after_s))
    return 1 if any(is_stalled(s, now, stall_after_s) for s in statuses) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.once:
        return check_once(args.workdir, args.stall_after)
    server = None
    if args.prometheus_port is not None:
        server = start_prometheus_server(args.workdir, args.prometheus_port, args.stall_after)
        print(f"Prometheus metrics at http://127.0.0.1:{server.server_address[1]}/metrics", file=sys.stderr)
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            statuses = read_statuses(args.workdir)
            table = (
                format_table(statuses, time.time(), args.stall_after) if statuses else "no status files yet"
            )
            print(f"{clear}{args.workdir}  {time.strftime('%H:%M:%S')}\n{table}", flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    raise SystemExit(main())
