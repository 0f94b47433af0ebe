"""A submitted workflow: its checks, and its ``core/ASSET`` references made kiln inputs.

Each reference (``{"__type": "core/ASSET", "info": {"id", "hash"?, "file_path"?}}``) is
resolved to one of the tenant's assets and replaced by a placeholder string naming its
content, ``kiln-asset://<blake3 hex>/<file name>``; the task's params map each placeholder
to the name of the kiln input holding the bytes, which the worker uploads to its ComfyUI.
The placeholder names the content, not the asset, so the opt-in dedup key (the canonical
params) is the graph with its assets' hashes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kiln.api.comfy.book import AssetBook, AssetRecord
from kiln.api.comfy.errors import V2Error
from kiln.models import JSON

ASSET_TYPE = "core/ASSET"
PLACEHOLDER = "kiln-asset://"
UI_KEYS = ("nodes", "links", "last_node_id")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: The longest file name kept in a placeholder and an input name.
NAME_MAX = 80


def check_graph(workflow: Any) -> JSON:
    """The API-format graph, or 422 ``invalid_workflow`` / ``workflow_format_ui``."""
    if not isinstance(workflow, dict) or not workflow:
        raise V2Error("invalid_workflow", "'workflow' must be an API-format graph (an object)")
    if all(key in workflow for key in UI_KEYS):
        raise V2Error(
            "workflow_format_ui",
            "this is a UI export of the workflow: export it in API format instead",
        )
    errors: dict[str, list[JSON]] = {}
    for node_id, node in workflow.items():
        if not isinstance(node, dict):
            errors[node_id] = [{"field": None, "reason": "not_an_object"}]
            continue
        found = []
        if not isinstance(node.get("class_type"), str) or not node["class_type"]:
            found.append({"field": "class_type", "reason": "missing_class_type"})
        if not isinstance(node.get("inputs"), dict):
            found.append({"field": "inputs", "reason": "missing_inputs"})
        if found:
            errors[node_id] = found
    if errors:
        first = next(iter(errors))
        raise V2Error(
            "invalid_workflow",
            f"node {first}: every node needs a class_type and an inputs object",
            details={"node_errors": errors},
        )
    return workflow


def is_reference(value: Any) -> bool:
    return isinstance(value, dict) and value.get("__type") == ASSET_TYPE


def safe_name(file_path: str) -> str:
    base = file_path.replace("\\", "/").rsplit("/", 1)[-1]
    return (_UNSAFE.sub("_", base).strip("._") or "file")[-NAME_MAX:]


def placeholder(record: AssetRecord) -> str:
    return f"{PLACEHOLDER}{record.hash.removeprefix('blake3:')}/{safe_name(record.file_path)}"


def input_name(record: AssetRecord) -> str:
    return f"{record.hash.removeprefix('blake3:')[:16]}-{safe_name(record.file_path)}"


@dataclass
class Resolved:
    """A graph with its references replaced, and what the task takes for them."""

    graph: JSON = field(default_factory=dict)
    assets: dict[str, str] = field(default_factory=dict)
    records: dict[str, AssetRecord] = field(default_factory=dict)


class _Resolver:
    def __init__(self, book: AssetBook, tenant: str) -> None:
        self.book = book
        self.tenant = tenant
        self.found: dict[str, AssetRecord] = {}
        self.missing: list[str] = []

    async def one(self, ref: JSON) -> AssetRecord | None:
        info = ref.get("info")
        if not isinstance(info, dict):
            self.missing.append("<core/ASSET without info>")
            return None
        asset_id, digest = info.get("id"), info.get("hash")
        record: AssetRecord | None = None
        if isinstance(asset_id, str) and asset_id:
            record = await self._by_id(asset_id)
        elif isinstance(digest, str) and digest:
            record = await self._by_hash(digest)
        if record is None:
            self.missing.append(str(asset_id or digest or "<core/ASSET without id>"))
        return record

    async def _by_id(self, asset_id: str) -> AssetRecord | None:
        if asset_id in self.found:
            return self.found[asset_id]
        try:
            record = await self.book.get(self.tenant, asset_id)
        except Exception:  # not found, malformed: both mean a missing asset
            return None
        if not await self.book.stored(record):
            return None
        self.found[asset_id] = record
        return record

    async def _by_hash(self, digest: str) -> AssetRecord | None:
        try:
            return await self.book.by_hash(self.tenant, digest)
        except V2Error:
            return None

    async def walk(self, value: Any, out: Resolved) -> Any:
        if is_reference(value):
            record = await self.one(value)
            if record is None:
                return value
            text = placeholder(record)
            out.assets[text] = input_name(record)
            out.records[input_name(record)] = record
            return text
        if isinstance(value, dict):
            return {key: await self.walk(item, out) for key, item in value.items()}
        if isinstance(value, list):
            return [await self.walk(item, out) for item in value]
        return value


async def resolve(book: AssetBook, tenant: str, graph: JSON) -> Resolved:
    """The graph with each reference replaced (422 ``missing_asset`` naming every one that
    is malformed, unknown to the tenant or whose bytes are gone)."""
    resolver = _Resolver(book, tenant)
    out = Resolved()
    out.graph = await resolver.walk(graph, out)
    if resolver.missing:
        raise V2Error(
            "missing_asset",
            f"core/ASSET reference(s) that are not assets of yours: {', '.join(resolver.missing)}",
            details={"missing_ids": resolver.missing},
        )
    return out


async def restore(book: AssetBook, tenant: str, value: Any) -> Any:
    """The graph as submitted: each placeholder a ``core/ASSET`` reference again."""
    if isinstance(value, str) and value.startswith(PLACEHOLDER):
        digest, _, file_path = value.removeprefix(PLACEHOLDER).partition("/")
        info: JSON = {"hash": f"blake3:{digest}", "file_path": file_path}
        try:
            record = await book.by_hash(tenant, f"blake3:{digest}")
        except V2Error:
            record = None
        info = {"id": record.id if record else f"blake3:{digest}", **info}
        if record is not None:
            info["file_path"] = record.file_path
        return {"__type": ASSET_TYPE, "info": info}
    if isinstance(value, dict):
        return {key: await restore(book, tenant, item) for key, item in value.items()}
    if isinstance(value, list):
        return [await restore(book, tenant, item) for item in value]
    return value
