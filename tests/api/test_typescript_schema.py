"""The TypeScript client of clients/typescript against the document: its committed
`schema.d.ts` is what openapi-typescript makes of the served /openapi.json, and the
request examples of the docs type-check as its request bodies (`tsc --noEmit`)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_support import running_api
from openapi_support import served_kiln

from doc_examples import ROOT, Example, blocks, examples
from kiln.config import Settings
from typescript_support import CLIENT, GENERATE_FLAGS, SCHEMA, install, tool

TSC_FLAGS = (
    "--noEmit",
    "--strict",
    "--target",
    "ES2022",
    "--module",
    "ESNext",
    "--moduleResolution",
    "Bundler",
    "--skipLibCheck",
)


@pytest.fixture(scope="module")
def client_installed() -> Iterator[None]:
    install()
    yield


async def test_the_committed_schema_is_what_the_generator_makes_of_the_document(
    client_installed: None, settings: Settings, tmp_path: Path
) -> None:
    # Given the document kiln serve answers (its built-in kinds, no keys)
    async with running_api(settings, kiln_app=served_kiln(settings)) as served:
        document = (await served.client.get("/openapi.json")).json()
    (tmp_path / "openapi.json").write_text(json.dumps(document))
    # When openapi-typescript makes the types of it, as `npm run generate` does
    made = tool(
        "openapi-typescript",
        tmp_path / "openapi.json",
        *GENERATE_FLAGS,
        "--output",
        tmp_path / "schema.d.ts",
    )
    assert made.returncode == 0, made.stderr
    # Then they are the committed ones, byte for byte (else: make client-ts)
    generated, committed = (tmp_path / "schema.d.ts").read_text(), SCHEMA.read_text()
    diff = "".join(
        difflib.unified_diff(committed.splitlines(True), generated.splitlines(True), n=1)
    )
    assert generated == committed, f"schema.d.ts is stale (make client-ts):\n{diff[:4000]}"


def _body_type(example: Example) -> str:
    if example.files:
        return 'components["schemas"]["SubmitUploadRequest"]'
    method = example.method.lower()
    return (
        f'NonNullable<paths["{example.path}"]["{method}"]["requestBody"]>'
        '["content"]["application/json"]'
    )


def typed_examples(found: list[Example]) -> str:
    """A TypeScript module with each example as a constant of its request body's type."""
    schema = (CLIENT / "src" / "schema").as_posix()
    lines = [f'import type {{ components, paths }} from "{schema}";', ""]
    for number, example in enumerate(found):
        lines.append(f"// {example.id}")
        body = json.dumps(example.body, indent=2, ensure_ascii=False)
        lines.append(f"export const example{number}: {_body_type(example)} = {body};")
    return "\n".join(lines) + "\n"


def test_the_docs_examples_type_check_as_the_clients_request_bodies(
    client_installed: None, tmp_path: Path
) -> None:
    # Given every example of the docs that kiln takes (a refusal's fault, such as an ftp
    # webhook URL, is a value the types cannot tell from a good one), as typed constants
    taken = [e for e in examples() if not e.refused]
    assert len(taken) >= 15
    module = tmp_path / "docs-examples.ts"
    module.write_text(typed_examples(taken))
    # When tsc checks them against the generated types
    checked = tool("tsc", *TSC_FLAGS, module)
    # Then each one has its body's type
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_body_the_document_refuses_does_not_type_check(
    client_installed: None, tmp_path: Path
) -> None:
    # A misspelled field, a kind that takes no inputs naming one, a params of another kind
    wrong = [
        {"kind": "image.generate", "params": {"prompt": "a fox"}, "priorty": 1},
        {"kind": "image.generate", "params": {"prompt": "a fox"}, "inputs": {"image": "x"}},
        {"kind": "image.transform", "params": {"prompt": "a fox"}, "inputs": {"image": "x"}},
        {
            "kind": "pipeline",
            "params": {
                "steps": [{"name": "a", "kind": "image.transform", "params": {"prompt": "a fox"}}]
            },
        },
    ]
    for number, body in enumerate(wrong):
        module = tmp_path / f"wrong{number}.ts"
        module.write_text(typed_examples([Example("test", number, "POST", "/v1/tasks", body)]))
        checked = tool("tsc", *TSC_FLAGS, module)
        assert checked.returncode != 0, body
        assert "error TS" in checked.stdout, checked.stdout


def test_the_client_and_the_docs_resume_example_type_check(client_installed: None) -> None:
    checked = tool("tsc", "--noEmit", "-p", CLIENT)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _ts_blocks() -> list[str]:
    page = (ROOT / "docs" / "typescript.md").read_text()
    return [b.text for b in blocks(page) if b.lang == "ts"]


def test_the_typescript_docs_examples_type_check_with_the_package(
    client_installed: None, tmp_path: Path
) -> None:
    # Given each TypeScript block of docs/typescript.md, importing the package by its name
    found = _ts_blocks()
    assert len(found) >= 3
    index = (CLIENT / "src" / "index").as_posix()
    modules = []
    for number, text in enumerate(found):
        module = tmp_path / f"doc{number}.ts"
        module.write_text(text.replace('"@kiln/client"', f'"{index}"'))
        modules.append(module)
    # Then tsc takes them, as their readers' builds would
    checked = tool("tsc", *TSC_FLAGS, "--lib", "ES2022,DOM,DOM.Iterable", *modules)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_docs_resume_example_is_the_checked_example_file() -> None:
    follow = (CLIENT / "examples" / "follow.ts").read_text()
    shown = follow.replace('"../src/index"', '"@kiln/client"')
    body = shown.split("\n", 1)[1]  # its first line says where it comes from
    assert [b for b in _ts_blocks() if b.strip() == body.strip()], "docs/typescript.md differs"
