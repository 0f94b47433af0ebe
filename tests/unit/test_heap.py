"""kiln's processes and Python's cyclic garbage collector (KILN_GC_THRESHOLD): each check
runs in a fresh interpreter, whose collector is as Python starts it."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from kiln.cli import cli

CHECK = """
import gc, json
from kiln.cli.heap import settle_heap
class Startup:  # a cycle startup left behind, and an object that lives on
    pass
kept, lost = Startup(), Startup()
lost.me = lost
del lost
before = gc.get_threshold()
settle_heap({threshold})
print(json.dumps({{
    "before": before,
    "after": gc.get_threshold(),
    "frozen": gc.get_freeze_count(),
    "left": sum(type(o).__name__ == "Startup" for o in gc.get_objects()),
}}))
"""


def settled(threshold: int) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(threshold=threshold)],
        capture_output=True,
        text=True,
        check=True,
    )
    found: dict[str, object] = json.loads(done.stdout)
    return found


def test_a_started_process_freezes_what_it_keeps_and_collects_young_objects_less_often() -> None:
    # When a started process settles its heap with a threshold of 20,000
    found = settled(20_000)
    # Then young objects are collected every 20,000 allocations, the older generations as
    # Python set them
    before, after = found["before"], found["after"]
    assert isinstance(before, list) and after == [20_000, *before[1:]]
    # And what startup left alive is frozen out of collection, its garbage freed first
    assert isinstance(found["frozen"], int) and found["frozen"] > 1_000
    assert found["left"] == 0  # the frozen are not in the collected generations any more


def test_a_threshold_of_zero_leaves_the_collector_as_python_set_it() -> None:
    found = settled(0)
    assert found["after"] == found["before"] and found["frozen"] == 0
    assert isinstance(found["left"], int) and found["left"] >= 1  # still collected


def test_a_negative_threshold_is_refused_with_one_line() -> None:
    result = CliRunner().invoke(cli, ["worker"], env={"KILN_GC_THRESHOLD": "-5"})
    assert result.exit_code == 2
    assert result.stderr == "kiln: KILN_GC_THRESHOLD='-5': expected a whole number >= 0\n"
