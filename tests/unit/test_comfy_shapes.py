"""The v2 shapes of kiln's records (kiln.api.comfy): statuses, ids, progress, errors."""

from __future__ import annotations

import pytest

from kiln.api.comfy import shapes
from kiln.api.comfy.assets import byte_range
from kiln.api.comfy.errors import V2Error
from kiln.api.comfy.streams import preview_of, resume_after
from kiln.errors import InvalidRequest, Permanent
from kiln.kinds import ANY_INPUTS, TaskKind
from kiln.retry import classify
from kiln.states import RUNNING, Status

EXPECTED = {
    Status.PENDING: "queued",
    Status.WAITING_FOR_RESOURCE: "queued",
    Status.RETRYING: "queued",
    Status.GENERATING: "running",
    Status.UPLOADING: "running",
    Status.NEEDS_REVIEW: "running",
    Status.SUCCESS: "succeeded",
    Status.FAILED: "failed",
    Status.TIMEOUT: "expired",
    Status.CANCELLED: "canceled",
}


@pytest.mark.parametrize("status", list(Status))
def test_every_kiln_status_has_a_v2_status(status: Status) -> None:
    assert shapes.job_status(status) == EXPECTED[status]
    asked = shapes.job_status(status, cancel_requested=True)
    assert asked == ("canceling" if status in RUNNING else EXPECTED[status])
    assert asked in shapes.STATUSES


def test_an_output_id_names_its_task_and_output() -> None:
    task_id = "tsk_01jf0000000000000000000000"
    asset_id = shapes.output_asset_id(task_id, "9-ComfyUI_00001_.png")
    assert shapes.parse_output_id(asset_id) == (task_id, "9-ComfyUI_00001_.png")
    assert shapes.parse_output_id("9f8a1c0d-2b3e-4f56-8a7b-1c2d3e4f5a6b") is None
    assert shapes.parse_output_id(f"{task_id}.!!") is None
    assert shapes.split_output_name("9-ComfyUI_00001_.png") == ("9", "ComfyUI_00001_.png")
    assert shapes.split_output_name("image.png") == ("", "image.png")


def test_progress_names_the_node_executing() -> None:
    found = shapes.progress_json("node:12:KSampler", 5, 20, 7, False)
    assert found is not None
    assert (found["value"], found["current_node"], found["current_node_class"]) == (
        0.25,
        "12",
        "KSampler",
    )
    assert (found["step"], found["steps"], found["nodes_total"]) == (5, 20, 7)
    assert shapes.node_at("node:4").node_id == "4"
    assert shapes.node_at("denoise").message == "denoise"
    assert shapes.progress_json(None, None, None, 3, False) is None
    assert shapes.progress_json(None, None, None, 3, True)["value"] == 1.0  # type: ignore[index]


def test_a_node_failure_names_the_node() -> None:
    error = classify(
        Permanent(
            "boom",
            code="node_execution_error",
            details=[{"node_id": "12", "node_type": "KSampler", "exception_message": "boom"}],
        )
    )
    assert error["details"][0]["node_id"] == "12"
    found = shapes.error_json(error)
    assert found == {
        "code": "node_execution_error",
        "message": "boom",
        "node_id": "12",
        "class_type": "KSampler",
        "traceback": None,
    }
    assert "details" not in classify(Permanent("plain"))


def test_a_kind_may_take_any_inputs() -> None:
    async def handler(ctx: object, params: object) -> None:
        return None

    kind = TaskKind("any", handler, inputs=(ANY_INPUTS,))
    kind.check_inputs({}, [])
    kind.check_inputs({}, [{"name": "a"}, {"name": "b"}])
    with pytest.raises(InvalidRequest, match="twice"):
        kind.check_inputs({}, [{"name": "a"}, {"name": "a"}])
    with pytest.raises(InvalidRequest, match="does not take it"):
        TaskKind("none", handler).check_inputs({}, [{"name": "a"}])


def test_ranges() -> None:
    assert byte_range(None, 10) is None
    assert byte_range("bytes=2-4", 10) == (2, 4)
    assert byte_range("bytes=-3", 10) == (7, 9)
    assert byte_range("bytes=8-", 10) == (8, 9)
    assert byte_range("bytes=1-2,4-5", 10) is None  # several ranges: the whole body
    with pytest.raises(V2Error) as outside:
        byte_range("bytes=10-", 10)
    assert outside.value.status == 416


def test_event_ids_and_previews() -> None:
    assert resume_after("41") == (41, 0)
    assert resume_after("41.3") == (41, 3)  # derived events go on from 41.4
    assert resume_after(None) is None
    for bad in ("abc", "41.", "41.x", ".3", "41.3.1", f"41.{2**63}"):
        with pytest.raises(V2Error):
            resume_after(bad)
    assert preview_of("data:image/jpeg;base64,AAAA", "3") == {
        "node_id": "3",
        "content_type": "image/jpeg",
        "data_base64": "AAAA",
    }
    assert preview_of("https://example.com/x.jpg", "3") is None
