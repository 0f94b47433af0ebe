"""The demo painter: a procedural landscape that sharpens from noise, step by step.

The prompt and seed choose a palette and a landscape (sky, sun or moon, clouds, layered
hills, trees, water), and each denoising step blends that final picture with seeded noise,
the way a diffusion model's previews sharpen from static into an image. Everything here is
deterministic: the same arguments give the same pixels and, through `encode`, the same bytes.
"""

from __future__ import annotations

import base64
import colorsys
import functools
import hashlib
import io
import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from PIL import Image, ImageChops, ImageDraw, ImageFilter, ImageFont

__all__ = ["encode", "preview", "render"]

# ---------------------------------------------------------------------------------------------
# The scene: what the prompt and seed decide

RGB = tuple[int, int, int]
_MaskPainter = Callable[[ImageDraw.ImageDraw, int], None]

_COLOR_HUES = {
    "red": 0.0,
    "crimson": 0.97,
    "scarlet": 0.99,
    "orange": 0.07,
    "amber": 0.1,
    "gold": 0.12,
    "golden": 0.12,
    "yellow": 0.15,
    "green": 0.33,
    "emerald": 0.38,
    "teal": 0.48,
    "cyan": 0.5,
    "blue": 0.6,
    "azure": 0.57,
    "indigo": 0.68,
    "purple": 0.77,
    "violet": 0.78,
    "magenta": 0.86,
    "pink": 0.92,
    "rose": 0.95,
}
_NIGHT = frozenset({"night", "moon", "moonlit", "midnight", "stars", "starry", "dark", "galaxy"})
_DUSK = frozenset({"sunset", "sunrise", "dusk", "dawn", "evening", "twilight", "golden"})
_SNOW = frozenset({"snow", "snowy", "winter", "ice", "icy", "frost", "frozen", "arctic"})
_SAND = frozenset({"desert", "sand", "dune", "dunes", "canyon", "savanna"})
_WATER = frozenset({"ocean", "sea", "lake", "river", "beach", "water", "harbor", "coast"})
_TREES = frozenset({"forest", "tree", "trees", "pine", "woods", "snow", "winter", "mountain"})
_STOP = frozenset({"a", "an", "the", "in", "on", "of", "at", "with", "and", "by", "under"})


@dataclass(frozen=True, slots=True)
class _Scene:
    sky_top: RGB
    sky_middle: RGB
    sky_horizon: RGB
    glow: RGB
    ground: RGB
    mood: Literal["day", "dusk", "night"]
    snow: bool
    water: bool
    sun: bool
    clouds: bool
    trees: bool
    horizon: float
    sun_at: tuple[float, float]
    rng_seed: int


def _words(text: str | None) -> list[str]:
    return re.findall(r"[a-z]+", (text or "").lower())


def _word_hue(word: str) -> float:
    return int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") / 2**32


def _hsv(hue: float, saturation: float, value: float) -> RGB:
    red, green, blue = colorsys.hsv_to_rgb(hue % 1.0, saturation, value)
    return (round(red * 255), round(green * 255), round(blue * 255))


def _mix(first: RGB, second: RGB, amount: float) -> RGB:
    return (
        round(first[0] + (second[0] - first[0]) * amount),
        round(first[1] + (second[1] - first[1]) * amount),
        round(first[2] + (second[2] - first[2]) * amount),
    )


def _accent_hue(words: list[str], rng: random.Random) -> float:
    for word in words:
        if word in _COLOR_HUES:
            return _COLOR_HUES[word]
    content = [word for word in words if word not in _STOP] or ["kiln"]
    return _word_hue(content[int(rng.random() * len(content))])


def _mood(words: set[str], rng: random.Random) -> Literal["day", "dusk", "night"]:
    if words & _NIGHT:
        return "night"
    if words & _DUSK:
        return "dusk"
    return ("day", "dusk", "night")[int(rng.random() * 2.4)]


def _sky(mood: str, shift: float, accent: float) -> tuple[RGB, RGB, RGB, RGB]:
    """Top, middle and horizon colors of the sky, and the color of the sun or moon's light."""
    if mood == "night":
        top, horizon = _hsv(0.64 + shift, 0.75, 0.14), _hsv(0.62 + shift, 0.55, 0.42)
        return top, _mix(top, horizon, 0.5), horizon, _hsv(0.13, 0.08, 1)
    if mood == "dusk":
        middle = _hsv(accent - 0.08, 0.5, 0.78)
        return (
            _hsv(0.70 + shift, 0.55, 0.4),
            middle,
            _hsv(accent + 0.04, 0.55, 1),
            _hsv(accent, 0.6, 1),
        )
    top, horizon = _hsv(0.58 + shift, 0.55, 0.86), _hsv(0.55 + shift, 0.18, 0.99)
    return top, _mix(top, horizon, 0.5), horizon, _hsv(accent, 0.25, 1)


def _ground(words: set[str], mood: str, accent: float, shift: float) -> RGB:
    dim = {"day": 1.0, "dusk": 0.8, "night": 0.45}[mood]
    if words & _SNOW:
        return _hsv(0.6, 0.07, 0.97 * dim)
    if words & _SAND:
        return _hsv(0.09 + shift, 0.45, 0.85 * dim)
    return _hsv(0.3 + shift + (accent - 0.5) * 0.1, 0.55, 0.55 * dim)


def _scene(prompt: str, seed: int, negative_prompt: str | None) -> _Scene:
    words = _words(prompt)
    vocabulary = set(words)
    avoid = set(_words(negative_prompt))
    material = json.dumps([prompt, negative_prompt, seed]).encode()
    rng_seed = int.from_bytes(hashlib.sha256(material).digest()[:8], "big")
    rng = random.Random(rng_seed)
    shift = (rng.random() - 0.5) * 0.12
    accent = _accent_hue(words, rng)
    mood = _mood(vocabulary, rng)
    top, middle, low, glow = _sky(mood, shift, accent)
    horizon = 0.52 + rng.random() * 0.12
    return _Scene(
        sky_top=top,
        sky_middle=middle,
        sky_horizon=low,
        glow=glow,
        ground=_ground(vocabulary, mood, accent, shift),
        mood=mood,
        snow=bool(vocabulary & _SNOW),
        water=bool(vocabulary & _WATER) and "water" not in avoid,
        sun=not avoid & {"sun", "moon"},
        clouds=not avoid & {"cloud", "clouds"} and rng.random() < 0.85,
        trees=bool(vocabulary & _TREES or rng.random() < 0.35) and not avoid & {"tree", "trees"},
        horizon=horizon,
        sun_at=(0.15 + rng.random() * 0.7, horizon * (0.3 + rng.random() * 0.45)),
        rng_seed=rng_seed,
    )


# ---------------------------------------------------------------------------------------------
# Painting the final composition


def _vertical_gradient(size: tuple[int, int], *stops: RGB) -> Image.Image:
    height = max(size[1], 2)
    spans = len(stops) - 1
    column = Image.new("RGB", (1, height))
    colors = []
    for row in range(height):
        position = row / (height - 1) * spans
        index = min(int(position), spans - 1)
        colors.append(_mix(stops[index], stops[index + 1], position - index))
    column.putdata(colors)
    return column.resize(size, Image.Resampling.BILINEAR)


def _paint_sky(canvas: Image.Image, scene: _Scene, rng: random.Random) -> None:
    width, height = canvas.size
    horizon_y = round(height * scene.horizon)
    canvas.paste(scene.sky_horizon, (0, horizon_y, width, height))
    canvas.paste(
        _vertical_gradient(
            (width, horizon_y + 1), scene.sky_top, scene.sky_middle, scene.sky_horizon
        )
    )
    if scene.mood == "night":
        draw = ImageDraw.Draw(canvas)
        for _ in range(width * horizon_y // 900):
            x, y = rng.random() * width, rng.random() ** 1.6 * horizon_y
            shade = 150 + int(rng.random() * 105)
            draw.point((x, y), fill=(shade, shade, min(255, shade + 20)))


def _paint_sun(canvas: Image.Image, scene: _Scene) -> None:
    width, height = canvas.size
    centre = (scene.sun_at[0] * width, scene.sun_at[1] * height)
    radius = min(width, height) * (0.07 if scene.mood == "night" else 0.09)
    halo = max(2, round(radius * 7))
    glow_mask = Image.radial_gradient("L").resize((halo, halo), Image.Resampling.BILINEAR)
    strength = 150 if scene.mood == "dusk" else 110
    glow_mask = glow_mask.point(lambda v: strength * max(0, 128 - v) ** 2 // 128**2)
    corner = (round(centre[0] - halo / 2), round(centre[1] - halo / 2))
    canvas.paste(Image.new("RGB", (halo, halo), scene.glow), corner, glow_mask)
    box = (centre[0] - radius, centre[1] - radius, centre[0] + radius, centre[1] + radius)
    disc = _supersampled_mask(canvas.size, functools.partial(_ellipse, box))
    face = _mix(scene.glow, (255, 255, 255), 0.55 if scene.mood == "night" else 0.35)
    canvas.paste(face, (0, 0), disc)


def _paint_clouds(canvas: Image.Image, scene: _Scene, rng: random.Random) -> None:
    width, height = canvas.size
    small = (max(1, width // 4), max(1, height // 4))
    layer = Image.new("L", small, 0)
    draw = ImageDraw.Draw(layer)
    for _ in range(3 + int(rng.random() * 4)):
        cx = rng.random() * small[0]
        cy = small[1] * scene.horizon * (0.15 + rng.random() * 0.6)
        for _ in range(5):
            rx = small[0] * (0.05 + rng.random() * 0.09)
            ry = rx * (0.35 + rng.random() * 0.25)
            x, y = cx + (rng.random() - 0.5) * rx * 3, cy + (rng.random() - 0.5) * ry
            draw.ellipse([x - rx, y - ry, x + rx, y + ry], fill=60 + int(rng.random() * 70))
    blurred = layer.filter(ImageFilter.GaussianBlur(max(1, small[0] // 60)))
    mask = blurred.resize((width, height), Image.Resampling.BICUBIC)
    tint = _mix(scene.sky_horizon, (255, 255, 255), 0.5 if scene.mood != "night" else 0.1)
    canvas.paste(tint, (0, 0), mask)


def _supersampled_mask(size: tuple[int, int], paint: _MaskPainter) -> Image.Image:
    big = Image.new("L", (size[0] * 2, size[1] * 2), 0)
    paint(ImageDraw.Draw(big), 2)
    return big.reduce(2)


def _ellipse(box: tuple[float, float, float, float], draw: ImageDraw.ImageDraw, k: int) -> None:
    draw.ellipse([corner * k for corner in box], fill=255)


def _ridge(width: int, base_y: float, amplitude: float, rng: random.Random) -> list[float]:
    waves = [(1 + rng.random() * 3.5, rng.random() * math.tau, rng.random()) for _ in range(3)]
    total = sum(weight for _, _, weight in waves) or 1.0
    samples = max(8, width // 4)
    points = []
    for index in range(samples + 1):
        t = index / samples
        offset = sum(w * math.sin(f * math.tau * t + p) for f, p, w in waves) / total
        points.append(base_y - amplitude * (0.5 + 0.5 * offset))
    return points


def _paint_hills(canvas: Image.Image, scene: _Scene, rng: random.Random) -> None:
    width, height = canvas.size
    horizon_y = height * scene.horizon
    layers = 4
    for layer in range(layers):
        depth = layer / (layers - 1)
        base_y = horizon_y + (height - horizon_y) * (0.05 + 0.45 * depth)
        ridge = _ridge(width, base_y, height * (0.22 - 0.1 * depth), rng)
        near = _mix(scene.sky_horizon, scene.ground, 0.35 + 0.65 * depth)
        shade = 0.82 if scene.snow else 0.55
        far = _mix(near, (0, 0, 0), 1 - shade - depth * 0.1)
        mask = _supersampled_mask(canvas.size, functools.partial(_polygon, ridge, width, height))
        top = round(min(ridge))
        fill = _vertical_gradient((width, max(2, height - top)), near, far)
        canvas.paste(fill, (0, top), mask.crop((0, top, width, height)))
        if scene.trees and layer in (1, 2):
            _paint_trees(canvas, scene, ridge, depth, rng)


def _polygon(
    ridge: list[float], width: int, height: int, draw: ImageDraw.ImageDraw, k: int
) -> None:
    step = width / (len(ridge) - 1)
    outline = [(index * step * k, y * k) for index, y in enumerate(ridge)]
    draw.polygon([*outline, (width * k, height * k), (0, height * k)], fill=255)


def _pine(x: float, y: float, tall: float, k: int) -> tuple[list[list[float]], list[list[float]]]:
    tiers: list[list[float]] = []
    caps: list[list[float]] = []
    for tier in range(3):
        tip = y - tall * (1 - tier * 0.27)
        base = y - tall * (0.42 - tier * 0.21)
        half = tall * (0.2 + tier * 0.07)
        tiers.append([x * k, tip * k, (x - half) * k, base * k, (x + half) * k, base * k])
        cap_y = tip + (base - tip) * 0.35
        cap = half * 0.35
        caps.append([x * k, tip * k, (x - cap) * k, cap_y * k, (x + cap) * k, cap_y * k])
    return tiers, caps


def _paint_trees(
    canvas: Image.Image, scene: _Scene, ridge: list[float], depth: float, rng: random.Random
) -> None:
    width, height = canvas.size
    body = _mix(_mix(scene.ground, (8, 22, 24), 0.7), scene.sky_horizon, 0.45 - depth * 0.4)
    step = width / (len(ridge) - 1)
    stands: list[tuple[float, float, float]] = []
    x = rng.random() * width * 0.1
    while x < width:
        tall = height * (0.04 + rng.random() * 0.05) * (0.7 + depth * 0.6)
        if rng.random() < 0.7:
            stands.append((x, ridge[min(len(ridge) - 1, round(x / step))] + tall * 0.08, tall))
        x += tall * (0.25 + rng.random() * 1.2)

    def paint(part: int) -> _MaskPainter:
        def draw_part(draw: ImageDraw.ImageDraw, k: int) -> None:
            for x, y, tall in stands:
                for triangle in _pine(x, y, tall, k)[part]:
                    draw.polygon(triangle, fill=255)

        return draw_part

    canvas.paste(body, (0, 0), _supersampled_mask(canvas.size, paint(0)))
    if scene.snow:
        caps = _supersampled_mask(canvas.size, paint(1))
        canvas.paste(_mix(scene.ground, (255, 255, 255), 0.5), (0, 0), caps)


def _paint_water(canvas: Image.Image, scene: _Scene, rng: random.Random) -> None:
    width, height = canvas.size
    top = round(height * (scene.horizon + 0.08))
    reflection = canvas.crop((0, 2 * top - height, width, top)).transpose(
        Image.Transpose.FLIP_TOP_BOTTOM
    )
    deep = _mix(scene.sky_top, (0, 10, 30), 0.45)
    tint = _vertical_gradient(reflection.size, scene.sky_horizon, deep)
    shaded = Image.blend(reflection.filter(ImageFilter.BoxBlur(1)), tint, 0.5)
    ripples = Image.new("L", shaded.size, 0)
    draw = ImageDraw.Draw(ripples)
    for _ in range(height // 10):
        y = rng.random() ** 1.5 * shaded.size[1]
        x = rng.random() * width
        span = width * (0.01 + rng.random() * 0.06) * (0.5 + y / shaded.size[1])
        draw.line([(x - span, y), (x + span, y)], fill=40 + int(rng.random() * 90))
    shaded.paste(_mix(scene.glow, (255, 255, 255), 0.3), (0, 0), ripples)
    canvas.paste(shaded, (0, top))


def _vignette(canvas: Image.Image) -> Image.Image:
    ring = Image.radial_gradient("L").resize(canvas.size, Image.Resampling.BILINEAR)
    shade = ring.point(lambda v: 255 - max(0, v - 120) * 90 // 135)
    return ImageChops.multiply(canvas, Image.merge("RGB", (shade, shade, shade)))


# ---------------------------------------------------------------------------------------------
# The caption


_Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


def _wrap(text: str, font: _Font, max_width: float, max_lines: int) -> list[str]:
    """The caption's lines: words filled greedily, a word wider than a line cut where it
    stops fitting, and past ``max_lines`` the last line ends in an ellipsis.

    Only the lines shown are worked out, and every cut is found by galloping and bisecting
    on the prefix's width, so a 2,000-character prompt without a space costs a few dozen
    measurements rather than millions."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        if len(lines) > max_lines:
            break  # the lines past these are never shown
        candidate = f"{current} {word}".strip()
        if font.getlength(candidate) <= max_width:
            current = candidate
            continue
        if current:
            lines.append(current)
        current = word
        while len(current) > 1 and len(lines) <= max_lines:
            cut = _fitting_prefix(current, font, max_width)
            if cut == len(current):
                break
            lines.append(current[:cut])
            current = current[cut:]
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        keep = _longest(lambda n: font.getlength(last[:n] + "…") <= max_width, 0, len(last))
        lines[-1] = last[:keep].rstrip() + "…"
    return lines


def _fitting_prefix(text: str, font: _Font, max_width: float) -> int:
    """How many leading characters of ``text`` fit in ``max_width`` (at least 1)."""
    return _longest(lambda n: font.getlength(text[:n]) <= max_width, 1, len(text))


def _longest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in low..high with ``fits(n)``, where ``fits`` holds up to some n and
    not after it; ``low`` when nothing fits. Gallops up from ``low``, then bisects: about
    2·log2(answer) calls."""
    if not fits(low):
        return low
    good, step = low, 1
    while good + step <= high and fits(good + step):
        good += step
        step *= 2
    bad = min(good + step, high + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _caption(canvas: Image.Image, prompt: str) -> Image.Image:
    width, height = canvas.size
    size = max(9, min(48, round(min(width, height * 1.6) / 24)))
    font = ImageFont.load_default(size=size)
    pad = max(4, size // 2)
    lines = _wrap(" ".join(prompt.split()), font, width - 2 * pad, 3 if height >= 256 else 2)
    line_height = round(size * 1.25)
    band_height = line_height * len(lines) + 2 * pad
    overlay = Image.new("RGBA", canvas.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(overlay)
    draw.rectangle([0, height - band_height, width, height], fill=(8, 10, 16, 132))
    for index, line in enumerate(lines):
        y = height - band_height + pad + index * line_height
        draw.text((pad + 1, y + 1), line, font=font, fill=(0, 0, 0, 170))
        draw.text((pad, y), line, font=font, fill=(250, 248, 240, 255))
    return Image.alpha_composite(canvas.convert("RGBA"), overlay).convert("RGB")


# ---------------------------------------------------------------------------------------------
# Caches and the denoising blend


@functools.lru_cache(maxsize=8)
def _final(prompt: str, seed: int, width: int, height: int, negative: str | None) -> Image.Image:
    scene = _scene(prompt, seed, negative)
    rng = random.Random(scene.rng_seed)
    canvas = Image.new("RGB", (width, height))
    _paint_sky(canvas, scene, rng)
    if scene.sun:
        _paint_sun(canvas, scene)
    if scene.clouds:
        _paint_clouds(canvas, scene, rng)
    _paint_hills(canvas, scene, rng)
    if scene.water:
        _paint_water(canvas, scene, rng)
    return _caption(_vignette(canvas), prompt)


@functools.lru_cache(maxsize=8)
def _coarse(prompt: str, seed: int, width: int, height: int, negative: str | None) -> Image.Image:
    final = _final(prompt, seed, width, height, negative)
    small = final.resize((max(1, width // 16), max(1, height // 16)), Image.Resampling.BOX)
    return small.resize((width, height), Image.Resampling.BICUBIC)


@functools.lru_cache(maxsize=8)
def _noise(seed: int, width: int, height: int) -> Image.Image:
    material = f"kiln-demo-noise:{seed}:{width}x{height}".encode()
    fine = Image.frombytes("RGB", (width, height), _random_bytes(material, width * height * 3))
    latent = (max(1, width // 8), max(1, height // 8))
    blocks = Image.frombytes(
        "RGB", latent, _random_bytes(material + b":latent", latent[0] * latent[1] * 3)
    )
    return Image.blend(fine, blocks.resize((width, height), Image.Resampling.BICUBIC), 0.55)


def _random_bytes(material: bytes, count: int) -> bytes:
    return hashlib.shake_256(material).digest(count)


def _schedule(fraction: float) -> tuple[float, float]:
    signal = 1 - (1 - fraction) ** 2.2
    detail = fraction**1.3
    return signal, detail


def render(
    prompt: str,
    seed: int,
    width: int,
    height: int,
    step: int,
    total: int,
    negative_prompt: str | None = None,
) -> Image.Image:
    """The picture after `step` of `total` denoising steps, as an RGB image of width×height.

    Step 0 is almost pure noise; step `total` is the finished composition with the prompt as a
    caption. Pure and deterministic: the same arguments always give the same pixels. The
    composition and the noise are cached, so a step costs a couple of image blends. `step` is
    clamped into 0..total; `total` must be at least 1.
    """
    if total < 1:
        raise ValueError("total must be at least 1")
    if width < 1 or height < 1:
        raise ValueError("width and height must be positive")
    step = min(max(step, 0), total)
    final = _final(prompt, seed, width, height, negative_prompt)
    if step == total:
        return final.copy()
    signal, detail = _schedule(step / total)
    picture = Image.blend(_coarse(prompt, seed, width, height, negative_prompt), final, detail)
    jitter = int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:4], "big")
    noise = ImageChops.offset(_noise(seed, width, height), jitter % width, (jitter >> 16) % height)
    return Image.blend(noise, picture, signal)


# ---------------------------------------------------------------------------------------------
# Encoding


def encode(image: Image.Image, fmt: str) -> bytes:
    """The image as PNG, WEBP or JPEG bytes.

    No metadata is written (no timestamps, EXIF or ICC profile), so the same image always
    gives the same bytes.
    """
    buffer = io.BytesIO()
    if fmt == "png":
        image.save(buffer, format="PNG", compress_level=6, icc_profile=None)
    elif fmt == "webp":
        rgb = image if image.mode in ("RGB", "RGBA") else image.convert("RGB")
        rgb.save(buffer, format="WEBP", quality=90, method=4, exif=b"", icc_profile=None)
    elif fmt == "jpeg":
        image.convert("RGB").save(buffer, format="JPEG", quality=92, exif=b"", icc_profile=None)
    else:
        raise ValueError(f"unsupported format: {fmt!r}")
    return buffer.getvalue()


def preview(image: Image.Image, max_side: int = 96) -> str:
    """A small JPEG thumbnail of the image as a `data:image/jpeg;base64,...` URL."""
    thumbnail = image.convert("RGB")
    thumbnail.thumbnail((max_side, max_side), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    thumbnail.save(buffer, format="JPEG", quality=70)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
