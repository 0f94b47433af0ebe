"""What crosses the submit process's socket (kiln.store.submit_process): a submission, a
task, a policy and an error come back equal to what was sent; frames split anywhere are
read whole, in order."""

from __future__ import annotations

import marshal

import pytest

from kiln.errors import Conflict, KilnError, StoreUnavailable
from kiln.models import NewTask, Task, Timeouts, TraceContext
from kiln.states import Status
from kiln.store.claims import ClaimPolicy
from kiln.store.submit_process import (
    error_form,
    frame,
    frames,
    new_form,
    new_of,
    policy_form,
    policy_of,
    task_form,
    task_of,
)


def _new(**changes: object) -> NewTask:
    values: dict[str, object] = {
        "id": "tsk_1",
        "tenant": "acme",
        "kind": "image.generate",
        "params": {"prompt": "a fox", "steps": 30, "scale": 7.5, "tags": ["a", None, True]},
        "fingerprint": "f" * 64,
        "idempotency_key": None,
        "dedup_key": "d" * 64,
        "priority": -3,
        "max_attempts": 5,
        "deadline_s": 86400.0,
        "timeouts": Timeouts(1.0, 2.5, 3.0),
        "metadata": {"user": "u1"},
        "webhook": {"url": "https://example.com/h", "events": ["final"]},
        "model": "sdxl",
        "batch_key": "b1",
        "run_at": 1_700_000_000.25,
        "rerun_of": "tsk_0",
        "older_fingerprints": ("e" * 64,),
    }
    values.update(changes)
    return NewTask(**values)  # type: ignore[arg-type]


def test_a_submission_comes_back_equal() -> None:
    new = _new()
    assert new_of(marshal.loads(marshal.dumps(new_form(new)))) == new
    plain = NewTask("tsk_2", "t", "k", {}, "f", None, None, 0, 3, 10.0, Timeouts())
    assert new_of(marshal.loads(marshal.dumps(new_form(plain)))) == plain


def test_a_submission_with_a_trace_is_not_sent() -> None:
    traced = _new(trace=TraceContext("00-" + "1" * 32 + "-" + "2" * 16 + "-01"))
    with pytest.raises(ValueError, match="trace"):
        new_form(traced)


def test_a_task_comes_back_equal() -> None:
    task = Task(
        "tsk_1", "acme", "image.generate", Status.RETRYING, {"prompt": "a fox"},
        {"user": "u1"}, [{"sha256": "a" * 64}], 2, 1, 3, 4, 9, "key", "d" * 64, "f" * 64,
        "worker-1", 12.5, 13.0, 3600.0, 100.0, Timeouts(1.0, 2.0, 3.0), "sampling", 3, 30,
        11.0, True, 12.0, 14.0, 15.0, "results/tsk_1", {"code": "x"}, {"n": 1}, 1.0, 2.0,
        3.0, 4.0, None, webhook={"url": "u"}, model="m", batch_key="b",
        yield_requested_at=5.0, rerun_of="tsk_0", pipeline_id="pl_1", step="s", step_copy=2,
    )  # fmt: skip
    back = task_of(marshal.loads(marshal.dumps(task_form(task))))
    assert back == task
    assert back.status is Status.RETRYING


@pytest.mark.parametrize(
    "policy",
    [None, ClaimPolicy(), ClaimPolicy(aging_s=30.0, running_cap=2, running_caps={"a": 1})],
)
def test_a_policy_comes_back_equal(policy: ClaimPolicy | None) -> None:
    assert policy_of(marshal.loads(marshal.dumps(policy_form(policy)))) == policy


def test_fair_turns_are_not_sent() -> None:
    with pytest.raises(ValueError, match="fair"):
        policy_form(ClaimPolicy(fair=True))


def test_an_error_comes_back_as_itself_or_as_store_unavailable() -> None:
    import pickle

    conflict = pickle.loads(error_form(7, Conflict("the same content"))[2])
    assert isinstance(conflict, Conflict) and str(conflict) == "the same content"

    class Unpicklable(KilnError):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a} {b}")

    odd = pickle.loads(error_form(8, Unpicklable(1, 2))[2])
    assert isinstance(odd, StoreUnavailable) and "Unpicklable" in str(odd)


def test_frames_split_anywhere_are_read_whole_and_in_order() -> None:
    documents = [[(1, "a")], [(2, "b" * 5000)], ([1, 2, 3], [])]
    data = b"".join(frame(document) for document in documents)
    for cut in (1, 3, 4, 5, 100, 5003, len(data) - 1):
        buffer = bytearray(data[:cut])
        got = frames(buffer)
        buffer += data[cut:]
        got += frames(buffer)
        assert [list(g) if isinstance(g, tuple) else g for g in got] == [
            list(d) if isinstance(d, tuple) else d for d in documents
        ]
        assert buffer == bytearray()
