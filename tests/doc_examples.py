"""The request examples of README.md and docs/*.md, read from the markdown itself.

Three forms are found:

- a ``curl`` command with a body (``-d '<json>'``, or ``-F 'request=<json>'`` plus file
  parts) in a ``sh`` block: its method, path, headers and body;
- a fenced ``json`` block right after a marker comment
  ``<!-- request: METHOD PATH [admin] [refused] -->``;
- a ``client.submit(...)`` call in a ``python`` block: the body ``kiln.Client`` sends
  (:func:`kiln.client.submit_call`).

A marker comment ``<!-- request: refused -->`` right before a ``sh`` block marks its
curl commands as examples of a refusal. In a path, ``{task_id}`` stands for a task the
reader made before. In a body, a reference written with an ellipsis (``"sha256:9f2c…"``)
stands for a picture the reader uploaded before, and a name in a client call (``ref``,
an open file) for what the example made before it.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kiln.client import submit_call

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*request:\s*(?P<spec>[^>]*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
#: A reference written short, for the content the reader uploaded before.
SHORT_REFERENCE = re.compile(r"^sha256:[0-9a-f]*(…|\.\.\.)$")


@dataclass
class Example:
    """One request of the docs: where it is, what it sends, whether it should be taken."""

    source: str
    line: int
    method: str
    path: str
    body: Any
    #: multipart/form-data: the names of the file parts (the JSON is ``body``).
    files: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    admin: bool = False
    refused: bool = False

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass
class Block:
    lang: str
    text: str
    line: int
    marker: str | None


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, each with the marker comment right before it."""
    found: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        start, indent = index, len(opening["indent"])
        index += 1
        body: list[str] = []
        while index < len(lines) and not FENCE.match(lines[index]):
            body.append(lines[index][indent:])
            index += 1
        before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = MARKER.match(before)
        found.append(
            Block(opening["lang"], "\n".join(body), start + 1, marker["spec"] if marker else None)
        )
        index += 1
    return found


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Shell lines with their continuations (``\\``) and multi-line quotes joined."""
    joined: list[tuple[int, str]] = []
    current, first = "", 0
    for number, raw in enumerate(text.splitlines()):
        if not current and raw.lstrip().startswith("#"):
            continue
        if not current:
            first = number
        current += raw[:-1] + " " if raw.endswith("\\") else raw + "\n"
        if raw.endswith("\\") or current.count("'") % 2:
            continue
        joined.append((first, current.strip()))
        current = ""
    return joined


def _curl(words: list[str]) -> tuple[str, str, dict[str, str], str | None, list[str]]:
    method, url, headers, data, forms = "", "", {}, None, []
    taking = iter(words[1:])
    for word in taking:
        if word == "-X":
            method = next(taking)
        elif word == "-H":
            name, _, value = next(taking).partition(":")
            headers[name.strip()] = value.strip()
        elif word in ("-d", "--data"):
            data = next(taking)
        elif word == "-F":
            forms.append(next(taking))
        elif word == "-o":
            next(taking)
        elif not word.startswith("-"):
            url = word
    return method, url, headers, data, forms


def curl_examples(source: str, block: Block) -> list[Example]:
    found = []
    for offset, line in _logical_lines(block.text):
        words = shlex.split(line, comments=True)
        if not words or words[0] != "curl":
            continue
        method, url, headers, data, forms = _curl(words)
        if data is None and not forms:
            continue  # a GET: nothing to check against a request body
        files = [f.split("=", 1)[0] for f in forms if f.split("=", 1)[1].startswith("@")]
        request = next((f.split("=", 1)[1] for f in forms if f.startswith("request=")), data)
        assert request is not None, f"{source}:{block.line + offset + 1}: no JSON body"
        path = urlsplit(url if "://" in url else f"http://{url}").path
        found.append(
            Example(
                source,
                block.line + offset + 1,
                method or "POST",
                path,
                json.loads(request),
                files,
                {k: v for k, v in headers.items() if k != "Content-Type"},
                refused=block.marker == "refused",
            )
        )
    return found


def marked_example(source: str, block: Block) -> Example:
    assert block.marker is not None
    words = block.marker.split()
    flags = set(words[2:])
    assert flags <= {"admin", "refused"}, f"{source}:{block.line}: unknown flags {flags}"
    return Example(
        source,
        block.line,
        words[0],
        words[1],
        json.loads(block.text),
        admin="admin" in flags,
        refused="refused" in flags,
    )


class _Placeholder:
    """A name a client call passes (``ref``, ``photo``): what the example made before."""

    def __init__(self, name: str) -> None:
        self.name = name


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values, strict=True) if k}
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.Name | ast.Attribute | ast.Call):
        return _Placeholder(ast.unparse(node))
    return ast.literal_eval(node)


def client_examples(source: str, block: Block) -> list[Example]:
    """The ``client.submit(...)`` calls of a python block, as the bodies the client sends."""
    found = []
    for node in ast.walk(ast.parse(block.text)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "submit"
            and ast.unparse(node.func.value) == "client"
        ):
            continue
        args = [_value(arg) for arg in node.args]
        fields = {kw.arg: _value(kw.value) for kw in node.keywords if kw.arg}
        files = fields.pop("files", None) or {}
        key = fields.pop("idempotency_key", None)
        kind = args[0] if args else "image.generate"
        call = submit_call(kind, args[1] if len(args) > 1 else None, key, fields)
        body = json.loads(json.dumps(call.body, default=lambda _: "sha256:…"))
        found.append(
            Example(
                source,
                block.line + node.lineno,
                "POST",
                call.path,
                body,
                sorted(files),
                dict(call.headers),
            )
        )
    return found


def examples() -> list[Example]:
    """Every request example of README.md and docs/*.md, in file order."""
    found: list[Example] = []
    for path in doc_files():
        source = path.relative_to(ROOT).as_posix()
        for block in blocks(path.read_text()):
            if block.lang == "sh":
                found += curl_examples(source, block)
            elif block.lang == "json" and block.marker is not None:
                found.append(marked_example(source, block))
            elif block.lang == "python":
                found += client_examples(source, block)
    return found


def with_references(value: Any, reference: str) -> Any:
    """``value`` with each short reference (``sha256:9f2c…``) replaced by ``reference``."""
    if isinstance(value, dict):
        return {k: with_references(v, reference) for k, v in value.items()}
    if isinstance(value, list):
        return [with_references(v, reference) for v in value]
    if isinstance(value, str) and SHORT_REFERENCE.match(value):
        return reference
    return value
