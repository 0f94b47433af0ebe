"""The demo image generator: parameters, deterministic rendering, encoding and previews."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image, ImageChops, ImageStat
from pydantic import ValidationError

from kiln.demo import (
    MAX_SEED,
    OUTPUT_NAMES,
    GenerateParams,
    Simulate,
    derive_seed,
    encode,
    normalize,
    preview,
    render,
)

PROMPT = "a red fox in snow"
SIZE = 128


def make_params(**overrides: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, **overrides}


def png(image: Image.Image) -> bytes:
    return encode(image, "png")


def mean_difference(first: Image.Image, second: Image.Image) -> float:
    return sum(ImageStat.Stat(ImageChops.difference(first, second)).mean) / 3


# --- render ----------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 7, 29, 30])
def test_same_arguments_render_the_same_bytes(step: int) -> None:
    # Given a rendered step
    first = png(render(PROMPT, 7, SIZE, SIZE, step, 30))

    # When the caches are pushed out by other renders and the same step is rendered again
    for other in range(12):
        render(f"filler {other}", other, 64, 72, 3, 30)
    again = png(render(PROMPT, 7, SIZE, SIZE, step, 30))

    # Then the bytes are identical
    assert again == first


def test_negative_prompt_is_part_of_the_picture() -> None:
    plain = render(PROMPT, 7, SIZE, SIZE, 30, 30)
    negative = render(PROMPT, 7, SIZE, SIZE, 30, 30, negative_prompt="trees, sun")
    assert mean_difference(plain, negative) > 1


def test_different_seeds_render_different_images() -> None:
    first = render(PROMPT, 1, SIZE, SIZE, 30, 30)
    second = render(PROMPT, 2, SIZE, SIZE, 30, 30)
    assert mean_difference(first, second) > 1


def test_different_prompts_render_different_images() -> None:
    fox = render(PROMPT, 7, SIZE, SIZE, 30, 30)
    ocean = render("moonlit ocean with stars", 7, SIZE, SIZE, 30, 30)
    assert mean_difference(fox, ocean) > 1


def test_steps_denoise_towards_the_final_composition() -> None:
    # Given the finished picture
    final = render(PROMPT, 7, 256, 256, 30, 30)

    # When earlier steps are compared with it
    distances = [mean_difference(render(PROMPT, 7, 256, 256, s, 30), final) for s in (0, 10, 20)]

    # Then each later step is closer, and the first step is mostly noise
    assert distances == sorted(distances, reverse=True)
    assert distances[0] > 40
    assert distances[-1] < distances[0] / 4


def test_render_has_the_requested_size_and_mode() -> None:
    image = render(PROMPT, 7, 200, 96, 5, 30)
    assert image.size == (200, 96)
    assert image.mode == "RGB"


def test_returned_final_image_can_be_changed_without_touching_the_cache() -> None:
    image = render(PROMPT, 7, SIZE, SIZE, 30, 30)
    expected = png(image)
    image.paste((0, 0, 0), (0, 0, SIZE, SIZE))
    assert png(render(PROMPT, 7, SIZE, SIZE, 30, 30)) == expected


def test_step_outside_the_run_is_clamped() -> None:
    assert png(render(PROMPT, 7, SIZE, SIZE, 99, 30)) == png(render(PROMPT, 7, SIZE, SIZE, 30, 30))
    assert png(render(PROMPT, 7, SIZE, SIZE, -3, 30)) == png(render(PROMPT, 7, SIZE, SIZE, 0, 30))


def test_a_run_needs_at_least_one_step() -> None:
    with pytest.raises(ValueError, match="total"):
        render(PROMPT, 7, SIZE, SIZE, 0, 0)


def test_a_very_long_prompt_still_renders() -> None:
    image = render("word " * 400, 3, 64, 64, 30, 30)
    assert image.size == (64, 64)


# --- encode and preview ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "pillow_format"), [("png", "PNG"), ("webp", "WEBP"), ("jpeg", "JPEG")]
)
def test_encode_writes_a_valid_image_of_the_right_size(fmt: str, pillow_format: str) -> None:
    data = encode(render(PROMPT, 7, 192, 128, 30, 30), fmt)
    with Image.open(io.BytesIO(data)) as decoded:
        assert decoded.format == pillow_format
        assert decoded.size == (192, 128)
        decoded.load()


@pytest.mark.parametrize("fmt", ["png", "webp", "jpeg"])
def test_encode_is_deterministic(fmt: str) -> None:
    image = render(PROMPT, 7, SIZE, SIZE, 12, 30)
    assert encode(image, fmt) == encode(image.copy(), fmt)


def test_encode_writes_jpeg_from_an_image_with_alpha() -> None:
    data = encode(Image.new("RGBA", (16, 16), (255, 0, 0, 128)), "jpeg")
    with Image.open(io.BytesIO(data)) as decoded:
        assert decoded.mode == "RGB"


def test_encode_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="gif"):
        encode(render(PROMPT, 7, 64, 64, 30, 30), "gif")


def test_output_names_follow_the_api() -> None:
    assert OUTPUT_NAMES == {
        "png": ("image.png", "image/png"),
        "webp": ("image.webp", "image/webp"),
        "jpeg": ("image.jpg", "image/jpeg"),
    }


def test_preview_is_a_small_jpeg_data_url() -> None:
    url = preview(render(PROMPT, 7, 256, 128, 4, 30))
    prefix = "data:image/jpeg;base64,"
    assert url.startswith(prefix)
    with Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :]))) as thumbnail:
        assert thumbnail.format == "JPEG"
        assert thumbnail.size == (96, 48)


def test_preview_honours_max_side() -> None:
    url = preview(render(PROMPT, 7, 128, 256, 4, 30), max_side=32)
    data = base64.b64decode(url.split(",", 1)[1])
    with Image.open(io.BytesIO(data)) as thumbnail:
        assert thumbnail.size == (16, 32)


# --- params ----------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [64, 72, 512, 2048])
def test_width_within_bounds_is_accepted(width: int) -> None:
    assert GenerateParams.model_validate(make_params(width=width, height=width)).width == width


@pytest.mark.parametrize(
    "overrides",
    [
        {"width": 63},
        {"width": 65},
        {"width": 2056},
        {"height": 56},
        {"height": 100},
        {"steps": 0},
        {"steps": 151},
        {"seed": -1},
        {"seed": MAX_SEED + 1},
        {"format": "gif"},
        {"prompt": ""},
        {"prompt": "x" * 2001},
        {"negative_prompt": "x" * 2001},
        {"sampler": "euler"},
        {"simulate": {"explode": True}},
        {"simulate": {"step_ms": 10_001}},
        {"simulate": {"fail_attempts": 11}},
        {"simulate": {"stall_attempts": -1}},
        {"simulate": {"fail_code": "Not Allowed"}},
        {"simulate": {"fail_code": ""}},
        {"simulate": {"fail_code": "x" * 65}},
    ],
)
def test_params_out_of_bounds_are_rejected(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        GenerateParams.model_validate(make_params(**overrides))


def test_prompt_is_required() -> None:
    with pytest.raises(ValidationError):
        GenerateParams.model_validate({"width": 512})


def test_params_defaults() -> None:
    params = GenerateParams.model_validate(make_params())
    assert (params.width, params.height, params.steps) == (512, 512, 30)
    assert (params.seed, params.format, params.simulate, params.negative_prompt) == (
        None,
        "png",
        None,
        None,
    )


def test_simulate_defaults() -> None:
    simulate = Simulate()
    assert simulate.step_ms == 40
    assert (simulate.fail_attempts, simulate.stall_attempts) == (0, 0)
    assert simulate.fail_code == "simulated_failure"
    assert not simulate.permanent
    assert not simulate.review


def test_params_accept_edge_values() -> None:
    params = GenerateParams.model_validate(
        make_params(
            steps=150,
            seed=MAX_SEED,
            negative_prompt="x" * 2000,
            simulate={"step_ms": 0, "fail_attempts": 10, "fail_code": "gpu.oom-1_x"},
        )
    )
    assert params.simulate is not None
    assert params.simulate.fail_code == "gpu.oom-1_x"


def test_json_schema_shows_the_bounds() -> None:
    properties = GenerateParams.model_json_schema()["properties"]
    assert properties["width"]["minimum"] == 64
    assert properties["width"]["maximum"] == 2048
    assert properties["width"]["multipleOf"] == 8
    assert properties["steps"]["maximum"] == 150
    assert properties["prompt"]["maxLength"] == 2000


# --- seeds -----------------------------------------------------------------------------------


def test_derive_seed_is_deterministic_and_in_range() -> None:
    params = {"prompt": PROMPT, "width": 512, "height": 512, "steps": 30}
    seed = derive_seed(params)
    assert seed == derive_seed(dict(reversed(list(params.items()))))
    assert 0 <= seed <= MAX_SEED


def test_derive_seed_differs_for_different_requests() -> None:
    seeds = {derive_seed({"prompt": f"fox {n}"}) for n in range(50)}
    assert len(seeds) == 50
    assert all(0 <= seed <= MAX_SEED for seed in seeds)


def test_derive_seed_ignores_a_seed_key() -> None:
    assert derive_seed({"prompt": PROMPT, "seed": None}) == derive_seed({"prompt": PROMPT})


def test_effective_seed_prefers_the_given_seed() -> None:
    assert GenerateParams.model_validate(make_params(seed=7)).effective_seed() == 7


@pytest.mark.parametrize(
    "params",
    [
        {"prompt": "a fox"},
        {"prompt": "x", "negative_prompt": "y", "width": 640, "steps": 12, "format": "webp"},
        {"prompt": "m", "model": "sdxl"},
        {"prompt": "s", "simulate": {"fail_attempts": 1, "step_ms": 0}},
        {"prompt": "é ☃ 🦊", "height": 768},
        {"prompt": "seeded", "seed": 5},
    ],
)
def test_the_stored_seed_is_the_one_rendered_with(params: dict[str, Any]) -> None:
    """``normalize`` derives the seed from the validated params' dump (no second
    validation): the same seed the model's ``effective_seed`` renders with."""
    model = GenerateParams.model_validate(params)
    stored = normalize(model.model_dump(mode="json", exclude_none=True))
    assert stored["seed"] == model.effective_seed()


def test_effective_seed_ignores_format_and_simulate() -> None:
    plain = GenerateParams.model_validate(make_params())
    other = GenerateParams.model_validate(make_params(format="jpeg", simulate={"step_ms": 0}))
    wider = GenerateParams.model_validate(make_params(width=640))
    assert plain.effective_seed() == other.effective_seed()
    assert plain.effective_seed() != wider.effective_seed()
