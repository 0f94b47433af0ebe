"""Inputs by reference from the client and the command line: a file uploaded once is
named by its content afterwards (``input_reference``, ``--input image=sha256:<hex>``) and
never sent again; against a real `kiln serve` process."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kiln
from images import opened, png
from kiln import errors
from kiln.cli import cli
from kiln.client import input_reference

from .conftest import Server

runner = CliRunner()


def fresh_png() -> bytes:
    """A picture no other test uploads."""
    return png(20 + uuid.uuid4().int % 300, 31)


def test_the_client_names_an_uploaded_file_by_its_reference(server: Server, tmp_path: Path) -> None:
    data = fresh_png()
    path = tmp_path / "in.png"
    path.write_bytes(data)
    ref = input_reference(data)
    assert ref == input_reference(path) and ref.startswith("sha256:") and len(ref) == 71
    with kiln.Client(server.url) as client:
        # Given content the server has never seen: naming it is refused
        with pytest.raises(errors.InvalidRequest):
            client.submit("image.transform", {"op": "convert"}, inputs={"image": ref})
        # When it is uploaded once, then named by reference for another operation
        first = client.submit("image.transform", {"op": "convert"},
                              files={"image": ("in.png", data)})  # fmt: skip
        params = {"op": "resize", "width": 9, "height": 7, "format": "webp"}
        submitted = client.submit("image.transform", params, inputs={"image": ref})
        done = client.wait(submitted["id"], timeout_s=30)
        output = client.download(done["id"], "image.webp")

    # Then the second task has the same input and ran on those bytes
    assert submitted["created"] is True and submitted["inputs"] == first["inputs"]
    assert done["status"] == "SUCCESS" and opened(output).size == (9, 7)


def test_kiln_submit_takes_an_input_by_reference(server: Server) -> None:
    data = fresh_png()
    with kiln.Client(server.url) as client:
        client.submit("image.transform", {"op": "convert"}, files={"image": ("a.png", data)})
    ref = input_reference(data).upper().replace("SHA256:", "sha256:")  # any case of hex

    result = runner.invoke(cli, ["submit", "image.transform", "-p", "op=thumbnail",
                                 "-p", "width=8", "-p", "height=8", "--input", f"image={ref}",
                                 "--wait", "--json", "--server", server.url])  # fmt: skip

    assert result.exit_code == 0, result.output
    task = json.loads(result.stdout[result.stdout.index("{\n") :])
    assert task["status"] == "SUCCESS"
    assert task["inputs"][0]["sha256"] == input_reference(data).removeprefix("sha256:")


def test_a_malformed_reference_is_refused_before_anything_is_sent(server: Server) -> None:
    args = ["submit", "image.transform", "-p", "op=convert", "--input", "image=sha256:abc"]

    result = runner.invoke(cli, [*args, "--server", server.url])

    assert result.exit_code == 2
    assert "64 hex digits" in result.stderr
