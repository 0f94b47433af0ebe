"""Fixtures for the backend tests: fake upstreams on loopback and a workflow file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from upstream_fakes import WORKFLOW, FakeComfyUI, FakeOpenAI, serve


@pytest.fixture
def openai_fake() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    with serve(fake.app(), fake.release) as url:
        fake.base_url = url
        yield fake


@pytest.fixture
def comfyui_fake() -> Iterator[tuple[FakeComfyUI, str]]:
    fake = FakeComfyUI()
    with serve(fake.app(), fake.release) as url:
        yield fake, url


@pytest.fixture
def workflow_path(tmp_path: Path) -> Path:
    path = tmp_path / "workflow_api.json"
    path.write_text(json.dumps(WORKFLOW), encoding="utf-8")
    return path
