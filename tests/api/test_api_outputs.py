"""GET /v1/tasks/{id}/outputs/{name}: the bytes, their ETag, and nothing else."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from api_support import ApiUnderTest, assert_error, bearer, image_body, raw_request

from kiln.reconcile import Options, ResultLostPolicy, reconcile


async def _finished(api: ApiUnderTest, **params: Any) -> dict[str, Any]:
    body = image_body("an output")
    body["params"].update(params)
    response = await api.submit(body)
    await api.kiln.wait(response.json()["id"], timeout_s=30)
    task: dict[str, Any] = (await api.client.get(f"/v1/tasks/{response.json()['id']}")).json()
    assert task["status"] == "SUCCESS", task
    return task


async def test_output_bytes_match_the_etag_and_the_record(working_api: ApiUnderTest) -> None:
    task = await _finished(working_api)
    output = task["result"]["outputs"][0]

    response = await working_api.client.get(output["url"])

    assert response.status_code == 200
    digest = hashlib.sha256(response.content).hexdigest()
    assert response.headers["etag"] == f'"{digest}"'
    assert digest == output["sha256"]
    assert len(response.content) == output["size"]
    assert response.headers["content-type"] == "image/png"
    assert response.content.startswith(b"\x89PNG")
    assert output["url"] == f"/v1/tasks/{task['id']}/outputs/image.png"
    assert set(output) == {"name", "content_type", "size", "sha256", "url"}


async def test_other_formats_keep_their_content_type(working_api: ApiUnderTest) -> None:
    task = await _finished(working_api, format="jpeg")
    output = task["result"]["outputs"][0]

    response = await working_api.client.get(output["url"])

    assert output["name"] == "image.jpg"
    assert response.headers["content-type"] == "image/jpeg"
    assert response.content.startswith(b"\xff\xd8")


async def test_matching_if_none_match_is_304(working_api: ApiUnderTest) -> None:
    task = await _finished(working_api)
    output = task["result"]["outputs"][0]
    etag = f'"{output["sha256"]}"'

    same = await working_api.client.get(output["url"], headers={"If-None-Match": etag})
    listed = await working_api.client.get(
        output["url"], headers={"If-None-Match": f'"other", W/{etag}'}
    )
    changed = await working_api.client.get(output["url"], headers={"If-None-Match": '"other"'})

    assert same.status_code == 304 and same.content == b""
    assert same.headers["etag"] == etag
    assert listed.status_code == 304
    assert changed.status_code == 200


TRAVERSALS = ["manifest.json", "..%2Fmanifest.json", "image.png%00", "IMAGE.PNG", "image.png "]
DOT_NAMES = ["..", ".", "../manifest.json", "..\\manifest.json"]


async def test_names_other_than_recorded_outputs_are_404(working_api: ApiUnderTest) -> None:
    task = await _finished(working_api)
    base = f"/v1/tasks/{task['id']}/outputs"

    for name in TRAVERSALS:
        response = await working_api.client.get(f"{base}/{name}")
        assert_error(response, 404, "not_found")
    for name in DOT_NAMES:
        status, body = await raw_request(
            working_api.http, "GET", f"{base}/{name}", headers=bearer(working_api.key or "")
        )
        assert status == 404, name
        assert json.loads(body)["error"]["code"] == "not_found"


async def test_outputs_are_404_until_success(keyed_api: ApiUnderTest) -> None:
    task = (await keyed_api.submit()).json()

    response = await keyed_api.client.get(f"/v1/tasks/{task['id']}/outputs/image.png")

    assert_error(response, 404, "not_found")


async def test_a_lost_result_shows_as_failed_result_lost_with_no_outputs(
    working_api: ApiUnderTest,
) -> None:
    # Given a SUCCESS task whose output is deleted behind the store's back
    task = await _finished(working_api)
    output = task["result"]["outputs"][0]
    stored = (await working_api.kiln.get(task["id"])).result
    assert stored is not None
    await working_api.kiln.storage.delete(stored["outputs"][0]["key"])

    # When a reconciliation repairs it under the fail policy
    report = await reconcile(
        working_api.kiln, Options(repair=True, result_lost=ResultLostPolicy.FAIL)
    )
    shown = (await working_api.client.get(f"/v1/tasks/{task['id']}")).json()
    fetched = await working_api.client.get(output["url"])

    # Then the API shows it FAILED result_lost with no result, and serves no output
    assert report.failed_count == 1
    assert (shown["status"], shown["final"], shown["result"]) == ("FAILED", True, None)
    assert shown["error"]["code"] == "result_lost"
    assert shown["finished_at"] is not None
    assert_error(fetched, 404, "not_found")
