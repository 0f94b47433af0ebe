"""The transition table: every (status, event) pair, replay of a log, the diagram, and an
illegal transition that reaches the engine."""

from __future__ import annotations

import itertools

import pytest

import kiln
from kiln.states import (
    FINAL,
    RULES,
    TRANSITIONS,
    Event,
    IllegalTransition,
    Status,
    check,
    is_allowed,
    mermaid,
    replay,
)

S = Status
E = Event
RUNNING = {S.WAITING_FOR_RESOURCE, S.GENERATING, S.UPLOADING}

#: DESIGN.md's event table, copied by hand: event -> (sources, targets). None is "—".
DESIGN_TABLE: dict[Event, tuple[set[Status | None], set[Status]]] = {
    E.SUBMIT: ({None}, {S.PENDING}),
    E.CLAIM: ({S.PENDING, S.RETRYING}, {S.WAITING_FOR_RESOURCE}),
    E.ACQUIRE: ({S.WAITING_FOR_RESOURCE}, {S.GENERATING}),
    E.GENERATED: ({S.GENERATING}, {S.UPLOADING}),
    E.UPLOADED: ({S.UPLOADING}, {S.SUCCESS, S.NEEDS_REVIEW}),
    E.APPROVE: ({S.NEEDS_REVIEW}, {S.SUCCESS}),
    E.REJECT: ({S.NEEDS_REVIEW}, {S.FAILED}),
    E.FAIL: (set(RUNNING), {S.FAILED}),
    E.SCHEDULE_RETRY: ({S.FAILED, S.TIMEOUT}, {S.RETRYING}),
    E.EXPIRE: (set(RUNNING), {S.TIMEOUT}),
    E.RECOVER: ({S.GENERATING, S.UPLOADING}, {S.SUCCESS}),
    E.CANCEL: ({S.PENDING, S.RETRYING, S.NEEDS_REVIEW}, {S.CANCELLED}),
    E.STOPPED: (set(RUNNING), {S.CANCELLED}),
    E.FORCE_CANCEL: (set(RUNNING), {S.CANCELLED}),
    E.RETRY: ({S.FAILED, S.TIMEOUT, S.CANCELLED}, {S.RETRYING}),
    E.DEADLINE: ({S.PENDING, S.RETRYING}, {S.TIMEOUT}),
    E.LOSE: ({S.SUCCESS}, {S.FAILED}),
    E.RELEASE: (set(RUNNING), {S.PENDING}),
    # A pipeline's own events (docs/pipelines.md), added to DESIGN.md's table.
    E.RUN_STEPS: ({S.PENDING, S.RETRYING}, {S.GENERATING}),
    E.STEPS_DONE: ({S.GENERATING}, {S.SUCCESS}),
    E.STEP_FAILED: ({S.GENERATING}, {S.FAILED}),
    E.STEPS_CANCELLED: ({S.GENERATING}, {S.CANCELLED}),
}

SOURCES: list[Status | None] = [None, *Status]
PAIRS = list(itertools.product(SOURCES, Event))


def test_table_matches_the_design_document() -> None:
    # Given the table in the code and the one copied from DESIGN.md
    from_code: dict[Event, tuple[set[Status | None], set[Status]]] = {}
    for rule in TRANSITIONS:
        sources: set[Status | None] = set(rule.sources) or {None}
        from_code[rule.event] = (sources, set(rule.targets))
    # Then they list the same events, sources and targets
    assert from_code == DESIGN_TABLE
    assert len(TRANSITIONS) == len(RULES) == len(Event)


def test_final_statuses_are_the_designed_ones() -> None:
    assert {S.SUCCESS, S.FAILED, S.TIMEOUT, S.CANCELLED} == FINAL


@pytest.mark.parametrize(("status", "event"), PAIRS, ids=[f"{s}-{e}" for s, e in PAIRS])
def test_every_status_event_pair_is_allowed_or_refused(status: Status | None, event: Event) -> None:
    sources, targets = DESIGN_TABLE[event]
    for target in [None, *Status]:
        # When the event is checked from the status toward each possible target
        allowed = status in sources and (
            target in targets if target is not None else len(targets) == 1
        )
        if allowed:
            # Then an allowed pair returns its target
            expected = target if target is not None else next(iter(targets))
            assert check(status, event, target) == expected
            assert is_allowed(status, event, target)
        else:
            # And every other pair raises IllegalTransition naming what was asked
            with pytest.raises(IllegalTransition) as refused:
                check(status, event, target)
            assert (refused.value.status, refused.value.event) == (status, event)
            assert not is_allowed(status, event, target)


def test_claim_from_pending_waits_for_a_resource() -> None:
    assert check(S.PENDING, E.CLAIM) is S.WAITING_FOR_RESOURCE


def test_retrying_task_can_be_claimed_again() -> None:
    assert check(S.RETRYING, E.CLAIM) is S.WAITING_FOR_RESOURCE


def test_cancel_of_a_generating_task_is_not_a_transition() -> None:
    with pytest.raises(IllegalTransition):
        check(S.GENERATING, E.CANCEL)


def test_uploaded_targets_success_or_review_only() -> None:
    assert check(S.UPLOADING, E.UPLOADED, S.SUCCESS) is S.SUCCESS
    assert check(S.UPLOADING, E.UPLOADED, S.NEEDS_REVIEW) is S.NEEDS_REVIEW
    for target in set(Status) - {S.SUCCESS, S.NEEDS_REVIEW}:
        with pytest.raises(IllegalTransition):
            check(S.UPLOADING, E.UPLOADED, target)
    with pytest.raises(IllegalTransition):
        check(S.UPLOADING, E.UPLOADED)  # two targets: the caller must choose


def test_final_success_leaves_only_when_its_result_is_lost() -> None:
    assert [e for e in Event if is_allowed(S.SUCCESS, e)] == [E.LOSE]
    assert check(S.SUCCESS, E.LOSE) is S.FAILED


def test_a_lost_result_can_be_rerun_in_the_same_transaction() -> None:
    log = [
        (E.SUBMIT, None, S.PENDING),
        (E.CLAIM, S.PENDING, S.WAITING_FOR_RESOURCE),
        (E.ACQUIRE, S.WAITING_FOR_RESOURCE, S.GENERATING),
        (E.GENERATED, S.GENERATING, S.UPLOADING),
        (E.UPLOADED, S.UPLOADING, S.SUCCESS),
        (E.LOSE, S.SUCCESS, S.FAILED),
        (E.SCHEDULE_RETRY, S.FAILED, S.RETRYING),
        (E.CLAIM, S.RETRYING, S.WAITING_FOR_RESOURCE),
    ]
    assert replay(log) is S.WAITING_FOR_RESOURCE


def test_only_submit_creates_a_task() -> None:
    assert [e for e in Event if is_allowed(None, e)] == [E.SUBMIT]
    with pytest.raises(IllegalTransition):
        check(S.PENDING, E.SUBMIT)


def test_expire_reaches_timeout_only_from_running_statuses() -> None:
    assert {s for s in Status if is_allowed(s, E.EXPIRE)} == RUNNING


def test_release_gives_a_running_task_back_to_the_queue_only() -> None:
    # Given every status
    # Then only a running one may be released, and it goes back to PENDING
    assert {s for s in Status if is_allowed(s, E.RELEASE)} == RUNNING
    for status in RUNNING:
        assert check(status, E.RELEASE) is S.PENDING
    for status in set(Status) - RUNNING:
        with pytest.raises(IllegalTransition):
            check(status, E.RELEASE)


def test_release_is_a_fenced_worker_event() -> None:
    rule = RULES[E.RELEASE]
    assert (rule.actor, rule.fenced) == (kiln.states.Actor.WORKER, True)


def test_a_released_task_is_claimed_again_and_can_succeed() -> None:
    # Given a task released from each running status by a stopping worker
    for running_log in (
        [(E.RELEASE, S.WAITING_FOR_RESOURCE, S.PENDING)],
        [(E.ACQUIRE, S.WAITING_FOR_RESOURCE, S.GENERATING),
         (E.RELEASE, S.GENERATING, S.PENDING)],
        [(E.ACQUIRE, S.WAITING_FOR_RESOURCE, S.GENERATING),
         (E.GENERATED, S.GENERATING, S.UPLOADING), (E.RELEASE, S.UPLOADING, S.PENDING)],
    ):  # fmt: skip
        log = [
            (E.SUBMIT, None, S.PENDING),
            (E.CLAIM, S.PENDING, S.WAITING_FOR_RESOURCE),
            *running_log,
            (E.CLAIM, S.PENDING, S.WAITING_FOR_RESOURCE),
            (E.ACQUIRE, S.WAITING_FOR_RESOURCE, S.GENERATING),
            (E.GENERATED, S.GENERATING, S.UPLOADING),
            (E.UPLOADED, S.UPLOADING, S.SUCCESS),
        ]
        # Then its log replays to SUCCESS
        assert replay(log) is S.SUCCESS
        assert replay(log[: 2 + len(running_log)]) is S.PENDING


def test_a_release_after_the_task_moved_on_does_not_replay() -> None:
    log = [
        (E.SUBMIT, None, S.PENDING),
        (E.CLAIM, S.PENDING, S.WAITING_FOR_RESOURCE),
        (E.EXPIRE, S.WAITING_FOR_RESOURCE, S.TIMEOUT),
        (E.RELEASE, S.TIMEOUT, S.PENDING),
    ]
    with pytest.raises(IllegalTransition):
        replay(log)


# replay ------------------------------------------------------------------------------------

HAPPY_LOG = [
    (E.SUBMIT, None, S.PENDING),
    (E.CLAIM, S.PENDING, S.WAITING_FOR_RESOURCE),
    (E.ACQUIRE, S.WAITING_FOR_RESOURCE, S.GENERATING),
    (E.FAIL, S.GENERATING, S.FAILED),
    (E.SCHEDULE_RETRY, S.FAILED, S.RETRYING),
    (E.CLAIM, S.RETRYING, S.WAITING_FOR_RESOURCE),
    (E.ACQUIRE, S.WAITING_FOR_RESOURCE, S.GENERATING),
    (E.GENERATED, S.GENERATING, S.UPLOADING),
    (E.UPLOADED, S.UPLOADING, S.NEEDS_REVIEW),
    (E.APPROVE, S.NEEDS_REVIEW, S.SUCCESS),
]


def test_replay_folds_a_log_into_the_current_status() -> None:
    assert replay(HAPPY_LOG) is S.SUCCESS
    assert replay(HAPPY_LOG[:5]) is S.RETRYING
    assert replay([]) is None


def test_replay_of_manual_retry_after_timeout() -> None:
    log = [
        (E.SUBMIT, None, S.PENDING),
        (E.DEADLINE, S.PENDING, S.TIMEOUT),
        (E.RETRY, S.TIMEOUT, S.RETRYING),
        (E.CANCEL, S.RETRYING, S.CANCELLED),
    ]
    assert replay(log) is S.CANCELLED


def test_replay_refuses_a_log_with_a_gap() -> None:
    # Given a log whose step starts from a status the task was not in
    broken = [*HAPPY_LOG[:2], (E.GENERATED, S.GENERATING, S.UPLOADING)]
    # Then replay refuses it
    with pytest.raises(IllegalTransition):
        replay(broken)


def test_replay_refuses_a_step_the_table_forbids() -> None:
    forbidden = [(E.SUBMIT, None, S.PENDING), (E.APPROVE, S.PENDING, S.SUCCESS)]
    with pytest.raises(IllegalTransition):
        replay(forbidden)


def test_replay_refuses_a_wrong_target() -> None:
    wrong = [(E.SUBMIT, None, S.PENDING), (E.CLAIM, S.PENDING, S.GENERATING)]
    with pytest.raises(IllegalTransition):
        replay(wrong)


def test_replay_refuses_a_log_that_does_not_start_with_submit() -> None:
    with pytest.raises(IllegalTransition):
        replay(HAPPY_LOG[1:])


# mermaid -----------------------------------------------------------------------------------


def test_mermaid_draws_every_rule() -> None:
    diagram = mermaid()
    lines = set(diagram.splitlines())
    assert diagram.startswith("stateDiagram-v2\n")
    for event, (sources, targets) in DESIGN_TABLE.items():
        for source, target in itertools.product(sources, targets):
            start = "[*]" if source is None else str(source)
            assert f"    {start} --> {target}: {event}" in lines
    for status in FINAL:
        assert f"    {status} --> [*]" in lines
    arrows = sum(len(s) * len(t) for s, t in DESIGN_TABLE.values()) + len(FINAL)
    assert len(lines) == arrows + 1


# through the engine --------------------------------------------------------------------------


async def test_illegal_transition_reaching_the_engine_is_refused_and_counted(
    app: kiln.App,
) -> None:
    # Given a PENDING task on a real store
    task = (await app.submit("image.generate", {"prompt": "a red fox"})).task
    events_before = await app.engine.store.events(task_id=task.id)
    # When the engine is asked to approve it
    with pytest.raises(IllegalTransition):
        await app.apply(task, Event.APPROVE)
    # Then nothing changed
    after = await app.engine.store.get(task.id)
    assert after is not None
    assert (after.status, after.version, after.epoch) == (S.PENDING, task.version, task.epoch)
    assert await app.engine.store.events(task_id=task.id) == events_before
    # And the refusal was counted, in the store and on the app
    illegal = {
        labels: n for (name, labels), n in (await app.engine.store.counters()).items()
        if name == "illegal_transitions"
    }  # fmt: skip
    assert list(illegal.values()) == [1]
    assert next(iter(illegal)).startswith("PENDING>")
    assert app.engine.illegal_transitions == 1


async def test_legal_transition_through_the_engine_is_not_counted_as_illegal(
    app: kiln.App,
) -> None:
    task = (await app.submit("image.generate", {"prompt": "a red fox"})).task
    cancelled = await app.apply(task, Event.CANCEL)
    assert cancelled.status is S.CANCELLED
    assert app.engine.illegal_transitions == 0
    assert not [key for key in await app.engine.store.counters() if key[0] == "illegal_transitions"]
