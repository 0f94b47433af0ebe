"""The params of a ``comfy.workflow`` task, and the model a task needs.

Importable without ComfyUI or a worker: the HTTP face (``kiln.api.comfy``) validates and
builds these params, and the worker driver registers the kind with them.

``workflow`` is ComfyUI's API-format graph (node id → ``{class_type, inputs, _meta?}``);
``extra_data`` goes to ComfyUI with the prompt; ``assets`` maps each placeholder string
that stands in the graph for an uploaded file to the name of the task input holding its
bytes (docs/comfy.md).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

KIND = "comfy.workflow"
#: The node inputs whose string value names a model file (warm routing and the ledger).
MODEL_INPUTS = (
    "ckpt_name", "unet_name", "lora_name", "vae_name", "clip_name", "control_net_name",
)  # fmt: skip


class ComfyNode(BaseModel):
    """One node of an API-format graph."""

    model_config = ConfigDict(extra="forbid", strict=False, serialize_by_alias=True)

    class_type: str = Field(min_length=1)
    inputs: dict[str, Any]
    meta: dict[str, Any] | None = Field(default=None, alias="_meta")


class ComfyWorkflowParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, serialize_by_alias=True)

    workflow: dict[str, ComfyNode] = Field(min_length=1)
    extra_data: dict[str, Any] = Field(default_factory=dict)
    assets: dict[str, str] = Field(default_factory=dict)

    def graph(self) -> dict[str, Any]:
        """The workflow as plain JSON, as ComfyUI takes it."""
        return {
            node_id: node.model_dump(mode="json", by_alias=True, exclude_none=True)
            for node_id, node in self.workflow.items()
        }


def models_of(params: dict[str, Any]) -> str | None:
    """The first model a graph loads (in node order), or None when it names none."""
    workflow = params.get("workflow")
    if not isinstance(workflow, dict):
        return None
    for node in workflow.values():
        inputs = node.get("inputs") if isinstance(node, dict) else None
        if not isinstance(inputs, dict):
            continue
        for name in MODEL_INPUTS:
            value = inputs.get(name)
            if isinstance(value, str) and value:
                return value
    return None
