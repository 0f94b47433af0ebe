"""Pipelines from the outside against a real `kiln serve` process (docs/pipelines.md): the
README's generate -> upscale -> thumbnail example run as written with curl, `kiln submit
pipeline --params-file ... --wait`, and `Client.submit_pipeline`."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from typer.testing import CliRunner

import kiln
from kiln.cli import cli

from .conftest import Server

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"<!-- pipeline-example:start -->\n```sh\n(.*?)```\n", re.S)


def small_steps() -> list[dict[str, Any]]:
    prompt = f"a lighthouse {uuid.uuid4().hex[:8]}"  # unique: no dedup across tests
    return [
        {"name": "generate", "kind": "image.generate",
         "params": {"prompt": prompt, "width": 64, "height": 64, "steps": 2,
                    "simulate": {"step_ms": 0}}},
        {"name": "thumbnail", "kind": "image.transform",
         "params": {"op": "thumbnail", "width": 16, "height": 16},
         "inputs": {"image": "step:generate/image.png"}},
    ]  # fmt: skip


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README example uses curl")
def test_the_readme_pipeline_example_runs_as_written(server: Server) -> None:
    # Given the README's curl command, aimed at the test server
    found = EXAMPLE.search((ROOT / "README.md").read_text(encoding="utf-8"))
    assert found is not None, "README.md has no pipeline example block"
    command = found.group(1).replace("http://127.0.0.1:8000", server.url)
    # When it runs
    answer = subprocess.run(["bash", "-c", command], capture_output=True, check=True, timeout=30)
    created = json.loads(answer.stdout)
    # Then the pipeline ran its three steps to the end
    with kiln.Client(server.url) as client:
        done = client.wait(created["id"], timeout_s=60)
        assert done["kind"] == "pipeline" and done["status"] == "SUCCESS"
        assert [(s["name"], s["status"]) for s in done["steps"]] == [
            ("generate", "SUCCESS"), ("upscale", "SUCCESS"), ("thumbnail", "SUCCESS"),
        ]  # fmt: skip
        [output] = done["steps"][-1]["outputs"]
        picture = Image.open(io.BytesIO(client.download(done["steps"][-1]["task_id"], "image.png")))
        assert output["name"] == "image.png" and picture.size == (128, 128)


def test_kiln_submit_pipeline_waits_and_prints_each_step(server: Server, tmp_path: Path) -> None:
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"steps": small_steps()}))
    result = CliRunner().invoke(
        cli, ["submit", "pipeline", "--params-file", str(steps), "--wait", "--server", server.url]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[-2].startswith("generate/0 SUCCESS http")
    assert lines[-1].startswith("thumbnail/0 SUCCESS http") and lines[-1].endswith("image.png")


def test_client_submit_pipeline(server: Server) -> None:
    with kiln.Client(server.url) as client:
        submitted = client.submit_pipeline(small_steps())
        # Its first step is in the answer, read after the commit: a worker of the server
        # may have taken it (or finished it) by then
        assert submitted["created"]
        assert submitted["steps"][0]["status"] in {
            "PENDING", "WAITING_FOR_RESOURCE", "GENERATING", "UPLOADING", "SUCCESS",
        }  # fmt: skip
        done = client.wait(submitted["id"], timeout_s=60)
    assert done["status"] == "SUCCESS"
    assert [s["status"] for s in done["steps"]] == ["SUCCESS", "SUCCESS"]
