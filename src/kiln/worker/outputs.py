"""An attempt's outputs: what the handler returned checked, reviewed, uploaded and each
verified in storage with the manifest that lets recovery find them, then reported
(``uploaded``: SUCCESS, or NEEDS_REVIEW when the kind's review flagged them)."""

from __future__ import annotations

from typing import Any

from kiln.errors import Retryable
from kiln.kinds import HandlerResult, call_review
from kiln.models import Output, StoredOutput
from kiln.states import Event, Status
from kiln.storage import Storage, sha256_hex, upload
from kiln.worker.attempt import Attempt
from kiln.worker.leases import Leases


def uploaded_fields(stored: list[StoredOutput]) -> dict[str, Any]:
    """The columns ``uploaded`` sets: the stored outputs as the task's result."""
    return {"result": {"outputs": [o.to_json() for o in stored]}, "error": None, "stage": None}


def as_outputs(result: HandlerResult) -> list[Output]:
    """The handler's result as a list of outputs; a name that repeats or could not be an
    object's name is refused (ValueError: the attempt fails)."""
    if result is None:
        return []
    if isinstance(result, Output):
        return [result]
    outputs = list(result)
    names = [o.name for o in outputs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate output names {names}")
    for name in names:
        if not name or "/" in name or name in (".", "..", "manifest.json"):
            raise ValueError(f"invalid output name {name!r}")
    return outputs


async def store_outputs(
    storage: Storage, attempt: Attempt, produced: list[Output], *, flagged: bool
) -> list[StoredOutput]:
    """Store the outputs, each verified, then the manifest that lets recovery find them."""
    prefix = attempt.task.result_prefix
    assert prefix is not None
    files = [
        (
            StoredOutput(
                name=output.name,
                key=f"{prefix}/{output.name}",
                content_type=output.content_type,
                size=len(output.data),
                sha256=sha256_hex(output.data),
            ),
            output.data,
        )
        for output in produced
    ]
    failed = await upload(storage, prefix, files, flagged=flagged)
    if failed is not None:
        raise Retryable(
            f"output {failed.name} did not verify in storage", code="storage_verify_failed"
        )
    return [record for record, _ in files]


async def deliver(
    leases: Leases, storage: Storage, attempt: Attempt, params: Any, produced: list[Output]
) -> None:
    """Review the outputs (the verdict goes into the manifest, written with them), store
    them and record ``uploaded``."""
    kind = attempt.kind
    flagged = bool(kind.review) and await call_review(kind.review, params, produced)  # type: ignore[arg-type]
    stored = await store_outputs(storage, attempt, produced, flagged=flagged)
    target = Status.NEEDS_REVIEW if flagged else Status.SUCCESS
    await leases.transition(attempt, Event.UPLOADED, target, fields=uploaded_fields(stored))
