"""The nodes of the stand-in ComfyUI (:mod:`tests.services.comfyui_standin`): their
``/object_info`` declarations, the validation of an API-format prompt as ComfyUI's
``execution.validate_prompt`` answers it, and what each node computes, with real
pictures (Pillow) deterministic from the seed, the prompt and the models.

Values between nodes: MODEL, CLIP and VAE are dicts naming the checkpoint and LoRAs;
CONDITIONING is ``{"text", "clip"}``; LATENT is ``{"width", "height", "batch_size"}``
(plus ``"images"`` once sampled); IMAGE is a list of Pillow images (a batch).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

INT = ("INT", {"default": 0, "min": 0, "max": 2**64 - 1})
FLOAT = ("FLOAT", {"default": 1.0})
STRING = ("STRING", {"multiline": True})
SAMPLERS = ["euler", "euler_ancestral", "dpmpp_2m", "ddim"]
SCHEDULERS = ["normal", "karras", "simple"]
SCALE_METHODS = ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]

#: class_type -> (required inputs, outputs, output node?); ``list`` specs are choices,
#: filled in for model files and input images by :func:`object_info`.
NODES: dict[str, tuple[dict[str, Any], list[str], bool]] = {
    "CheckpointLoaderSimple": ({"ckpt_name": ("CHECKPOINTS",)}, ["MODEL", "CLIP", "VAE"], False),
    "LoraLoader": (
        {
            "model": ("MODEL",),
            "clip": ("CLIP",),
            "lora_name": ("LORAS",),
            "strength_model": FLOAT,
            "strength_clip": FLOAT,
        },
        ["MODEL", "CLIP"],
        False,
    ),
    "CLIPTextEncode": ({"text": STRING, "clip": ("CLIP",)}, ["CONDITIONING"], False),
    "EmptyLatentImage": (
        {
            "width": ("INT", {"default": 512, "min": 16, "max": 4096}),
            "height": ("INT", {"default": 512, "min": 16, "max": 4096}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 16}),
        },
        ["LATENT"],
        False,
    ),
    "KSampler": (
        {
            "model": ("MODEL",),
            "seed": INT,
            "steps": ("INT", {"default": 20, "min": 1}),
            "cfg": FLOAT,
            "sampler_name": (SAMPLERS,),
            "scheduler": (SCHEDULERS,),
            "positive": ("CONDITIONING",),
            "negative": ("CONDITIONING",),
            "latent_image": ("LATENT",),
            "denoise": FLOAT,
        },
        ["LATENT"],
        False,
    ),
    "VAEDecode": ({"samples": ("LATENT",), "vae": ("VAE",)}, ["IMAGE"], False),
    "SaveImage": ({"images": ("IMAGE",), "filename_prefix": STRING}, [], True),
    "PreviewImage": ({"images": ("IMAGE",)}, [], True),
    "LoadImage": ({"image": ("INPUT_FILES",)}, ["IMAGE", "MASK"], False),
    "ImageScale": (
        {
            "image": ("IMAGE",),
            "upscale_method": (SCALE_METHODS,),
            "width": ("INT", {"default": 512, "min": 0}),
            "height": ("INT", {"default": 512, "min": 0}),
            "crop": (["disabled", "center"],),
        },
        ["IMAGE"],
        False,
    ),
}

#: Input types whose values come from another node (a link ``["<node id>", index]``).
LINKED = {"MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "MASK"}


class Choices:
    """The files a choice input may name: checkpoints, LoRAs and the input folder's images."""

    def __init__(self, checkpoints: list[str], loras: list[str], input_dir: Path) -> None:
        self.checkpoints, self.loras, self.input_dir = checkpoints, loras, input_dir

    def of(self, kind: str) -> list[str]:
        if kind == "CHECKPOINTS":
            return list(self.checkpoints)
        if kind == "LORAS":
            return list(self.loras)
        return sorted(
            str(p.relative_to(self.input_dir)) for p in self.input_dir.rglob("*") if p.is_file()
        )


def object_info(choices: Choices) -> dict[str, Any]:
    """``GET /object_info`` as ComfyUI answers it, for the nodes this server knows."""
    info = {}
    for name, (required, outputs, output_node) in NODES.items():
        shown = {
            key: (
                [choices.of(spec[0])]
                if spec[0] in ("CHECKPOINTS", "LORAS", "INPUT_FILES")
                else list(spec)
            )
            for key, spec in required.items()
        }
        info[name] = {
            "input": {"required": shown, "optional": {}},
            "input_order": {"required": list(required)},
            "output": outputs,
            "output_is_list": [False] * len(outputs),
            "output_name": outputs,
            "name": name,
            "display_name": name,
            "description": "",
            "python_module": "nodes",
            "category": "stand-in",
            "output_node": output_node,
        }
    return info


def _error(kind: str, message: str, details: str, name: str, value: Any) -> dict[str, Any]:
    return {
        "type": kind,
        "message": message,
        "details": details,
        "extra_info": {"input_name": name, "received_value": value},
    }


def _value_error(name: str, kind: Any, value: Any, choices: Choices) -> dict[str, Any] | None:
    """What is wrong with one widget value (not a link), or None."""
    if kind in ("CHECKPOINTS", "LORAS", "INPUT_FILES") or isinstance(kind, list):
        allowed = kind if isinstance(kind, list) else choices.of(kind)
        if value in allowed:
            return None
        if kind == "INPUT_FILES":
            details = f"{name} - Invalid image file: {value}"
            return _error(
                "custom_validation_failed",
                "Custom validation failed for node",
                details,
                name,
                value,
            )
        details = f"{name}: '{value}' not in {allowed}"
        return _error("value_not_in_list", "Value not in list", details, name, value)
    if kind in ("INT", "FLOAT") and (isinstance(value, bool) or not isinstance(value, int | float)):
        message = f"Failed to convert an input value to a {kind} value"
        return _error("invalid_input_type", message, f"{name}, {value}", name, value)
    return None


def _input_errors(
    prompt: Mapping[str, Any], node: Mapping[str, Any], choices: Choices
) -> list[dict[str, Any]]:
    """What ComfyUI's ``validate_inputs`` finds wrong with one node's inputs."""
    inputs = node.get("inputs") or {}
    errors = []
    for name, spec in NODES[node["class_type"]][0].items():
        value = inputs.get(name)
        if name not in inputs:
            found = _error("required_input_missing", "Required input is missing", name, name, None)
        elif isinstance(value, list):
            bad = len(value) != 2 or str(value[0]) not in prompt
            message = "Bad linked input, must be a length-2 list of [string, int]"
            found = (
                _error("bad_linked_input", message, f"{name}, {value}", name, value)
                if bad
                else None
            )
        else:
            found = _value_error(name, spec[0], value, choices)
        if found is not None:
            errors.append(found)
    return errors


def _invalid(kind: str, message: str, details: str = "") -> dict[str, Any]:
    return {"type": kind, "message": message, "details": details, "extra_info": {}}


def _graph_error(prompt: Any) -> dict[str, Any] | None:
    """What makes the whole prompt unrunnable before any input is looked at, or None."""
    if not isinstance(prompt, dict):
        return _invalid("invalid_prompt", "Prompt is not an object")
    for node_id, node in prompt.items():
        class_type = node.get("class_type") if isinstance(node, dict) else None
        if class_type is None:
            message = "Cannot execute because a node is missing the class_type property."
            return _invalid("invalid_prompt", message, f"Node ID '#{node_id}'")
        if class_type not in NODES:
            message = f"Cannot execute because node {class_type} does not exist."
            return _invalid("invalid_prompt", message, f"Node ID '#{node_id}'")
    if not any(NODES[node["class_type"]][2] for node in prompt.values()):
        return _invalid("prompt_no_outputs", "Prompt has no outputs")
    return None


def validate(
    prompt: Any, choices: Choices
) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """``(error, node_errors, output node ids)``: error None when the prompt may run."""
    error = _graph_error(prompt)
    if error is not None:
        return error, {}, []
    outputs = [node_id for node_id, node in prompt.items() if NODES[node["class_type"]][2]]
    node_errors: dict[str, Any] = {}
    for output in outputs:
        for node_id in order(prompt, [output]):
            errors = _input_errors(prompt, prompt[node_id], choices)
            if errors:
                class_type = prompt[node_id]["class_type"]
                entry = node_errors.setdefault(
                    node_id, {"errors": errors, "dependent_outputs": [], "class_type": class_type}
                )
                entry["dependent_outputs"].append(output)
    if node_errors:
        failed = _invalid("prompt_outputs_failed_validation", "Prompt outputs failed validation")
        return failed, node_errors, outputs
    return None, {}, outputs


def order(prompt: Mapping[str, Any], outputs: list[str]) -> list[str]:
    """The nodes the outputs need, each after the nodes it reads (depth first, as
    ComfyUI's execution list takes them)."""
    done: list[str] = []
    seen: set[str] = set()

    def visit(node_id: str) -> None:
        if node_id in seen or node_id not in prompt:
            return
        seen.add(node_id)
        for value in (prompt[node_id].get("inputs") or {}).values():
            if isinstance(value, list) and len(value) == 2:
                visit(str(value[0]))
        done.append(node_id)

    for output in outputs:
        visit(output)
    return done


def signature(prompt: Mapping[str, Any], node_id: str, extra: Mapping[str, str]) -> str:
    """What a node's output depends on: its class, its values and its inputs' signatures
    (and, for LoadImage, the file's content), as ComfyUI's cache keys do."""
    node = prompt[node_id]
    inputs = {
        key: signature(prompt, str(value[0]), extra) + f"#{value[1]}"
        if isinstance(value, list) and len(value) == 2
        else value
        for key, value in sorted((node.get("inputs") or {}).items())
    }
    text = json.dumps([node["class_type"], inputs, extra.get(node_id)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def picture(width: int, height: int, key: str) -> Image.Image:
    """A deterministic picture for ``key`` (seed, prompt and models): a sky and shapes."""
    rng = random.Random(hashlib.sha256(key.encode()).digest())
    top = tuple(rng.randrange(256) for _ in range(3))
    bottom = tuple(rng.randrange(256) for _ in range(3))
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    for y in range(height):
        t = y / max(height - 1, 1)
        draw.line(
            [(0, y), (width, y)],
            fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom, strict=True)),
        )
    for _ in range(8):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = (
            x0 + rng.randrange(4, max(width // 2, 5)),
            y0 + rng.randrange(4, max(height // 2, 5)),
        )
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    return image


def noisy(final: Image.Image, step: int, steps: int, key: str) -> Image.Image:
    """The picture ``step`` of ``steps`` into sampling: noise fading into ``final``."""
    rng = random.Random(key + str(step))
    noise = Image.frombytes("RGB", final.size, rng.randbytes(final.width * final.height * 3))
    return Image.blend(noise, final, step / steps)


def sample_key(model: Mapping[str, Any], positive: Mapping[str, Any], seed: int, index: int) -> str:
    """What a sampled picture depends on."""
    return json.dumps([model["ckpt"], model["loras"], positive["text"], seed, index])


def scale(
    images: list[Image.Image], method: str, width: int, height: int, crop: str
) -> list[Image.Image]:
    resample = {
        "nearest-exact": Image.Resampling.NEAREST,
        "bilinear": Image.Resampling.BILINEAR,
        "area": Image.Resampling.BOX,
        "bicubic": Image.Resampling.BICUBIC,
        "lanczos": Image.Resampling.LANCZOS,
    }[method]
    scaled = []
    for image in images:
        w = width or round(image.width * height / image.height)
        h = height or round(image.height * width / image.width)
        if crop == "center":
            ratio = max(w / image.width, h / image.height)
            big = image.resize((round(image.width * ratio), round(image.height * ratio)), resample)
            left, top = (big.width - w) // 2, (big.height - h) // 2
            scaled.append(big.crop((left, top, left + w, top + h)))
        else:
            scaled.append(image.resize((w, h), resample))
    return scaled


def txt2img(
    ckpt: str = "v1-5-pruned-emaonly.safetensors",
    prompt: str = "a lighthouse at dusk",
    *,
    seed: int = 7,
    steps: int = 4,
    size: int = 64,
    batch: int = 1,
    prefix: str = "kiln",
    lora: str | None = None,
) -> dict[str, Any]:
    """ComfyUI's default text-to-image graph in API format ("Save (API)"), optionally
    with a LoRA between the checkpoint and the sampler."""
    model, clip = ["4", 0], ["4", 1]
    graph: dict[str, Any] = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {
            "class_type": "EmptyLatentImage",
            "inputs": {"width": size, "height": size, "batch_size": batch},
        },
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": clip}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": clip}},
        "3": {
            "class_type": "KSampler",
            "inputs": {
                "model": model,
                "seed": seed,
                "steps": steps,
                "cfg": 7.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "positive": ["6", 0],
                "negative": ["7", 0],
                "latent_image": ["5", 0],
                "denoise": 1.0,
            },
        },
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}},
    }
    if lora is not None:
        graph["10"] = {
            "class_type": "LoraLoader",
            "inputs": {
                "model": model,
                "clip": clip,
                "lora_name": lora,
                "strength_model": 0.8,
                "strength_clip": 0.8,
            },
        }
        graph["3"]["inputs"]["model"] = ["10", 0]
        graph["6"]["inputs"]["clip"] = graph["7"]["inputs"]["clip"] = ["10", 1]
    return graph
