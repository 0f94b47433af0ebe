"""`kiln serve` (a real process) serves the Comfy API v2 beside /v1, to the official client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from comfy_low.models import Asset, ErrorEnvelope
from comfy_sdk import Comfy, NotFound

from .conftest import Processes

ALICE = "key-alice-0123456789"
BOB = "key-bob-0123456789"


def test_kiln_serve_answers_the_comfy_client(
    processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = processes.serve(tmp_path / "data", KILN_API_KEYS=f"alice:{ALICE},bob:{BOB}")
    monkeypatch.setenv("COMFY_BASE_URL", server.url)
    assert httpx.get(f"{server.url}/api/v2/health").json() == {"status": "healthy"}
    with Comfy(api_key=ALICE) as comfy:
        first = comfy.assets.from_bytes(b"hello asset", filename="hello.txt")
        asset_id = first.commit()
        second = comfy.assets.from_bytes(b"hello asset", filename="hello.txt")
        assert second.commit() == asset_id and second.created_new is False
        assert list(comfy.list_jobs()) == []
    headers = {"Authorization": f"Bearer {ALICE}"}
    found = httpx.get(f"{server.url}/api/v2/assets/{asset_id}", headers=headers)
    assert Asset.model_validate(found.json()).size_bytes == len(b"hello asset")
    with Comfy(api_key=BOB) as bob, pytest.raises(NotFound):
        bob.jobs.get("tsk_0000000000000000000000000a")
    other = httpx.get(
        f"{server.url}/api/v2/assets/{asset_id}", headers={"Authorization": f"Bearer {BOB}"}
    )
    assert other.status_code == 404
    assert ErrorEnvelope.model_validate(other.json()).error.code == "not_found"
