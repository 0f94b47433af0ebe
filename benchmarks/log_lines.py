"""What one engine log line costs: process CPU per transition line, text and JSON.

Logs are set up as ``kiln worker`` sets them up (``logs.setup``, INFO) and go to a temporary
file in place of stderr. Each figure logs N claim lines, then flushes, so the batch writer
thread's formatting and writing count too. ``log.info`` is the path of every other line;
``logs.line`` the per-transition one (skipped on trees that do not have it).

    .venv/bin/python benchmarks/log_lines.py --lines 50000

The last line is one JSON object with every figure, in µs per line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable

from kiln import logs

FIELDS = {
    "task_id": "tsk_01m8t051ktmj255fwvjs69csde", "attempt": 1, "epoch": 1, "from": "PENDING",
    "to": "WAITING_FOR_RESOURCE", "event": "claim", "duration_s": 0.0924123,
    "worker": "vm:14107:j8m283gh",
}  # fmt: skip


def cpu_us_per_line(emit: Callable[[], None], lines: int) -> float:
    started = time.process_time()
    for _ in range(lines):
        emit()
    for handler in logging.getLogger("kiln").handlers:
        handler.flush()
    return (time.process_time() - started) / lines * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000, help="lines per figure")
    args = parser.parse_args()
    log = logging.getLogger("kiln.store")
    paths: dict[str, Callable[[], None]] = {
        "log.info": lambda: log.info("transition", extra=dict(FIELDS)),
    }
    line = getattr(logs, "line", None)
    if line is not None:
        paths["logs.line"] = lambda: line(log, "transition", dict(FIELDS))
    figures: dict[str, float] = {}
    real_stderr = sys.stderr
    with tempfile.TemporaryFile("w") as sink:
        sys.stderr = sink
        try:
            for fmt in ("text", "json"):
                logs.setup(fmt=fmt, level="INFO")
                for name, emit in paths.items():
                    figures[f"{fmt} {name}"] = round(cpu_us_per_line(emit, args.lines), 2)
        finally:
            sys.stderr = real_stderr
    for name, us in figures.items():
        print(f"{name:16} {us:6.2f} µs per line")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
