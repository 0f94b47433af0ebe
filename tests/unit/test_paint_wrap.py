"""The caption's line wrapping: the same lines as ever, for work that grows with the
lines shown, not with the cube of the prompt's length (measured in text measurements)."""

from __future__ import annotations

import pytest
from PIL import ImageFont

from kiln.paint import _wrap


class CountingFont:
    """A font that counts how often text is measured, and how many characters."""

    def __init__(self, size: int) -> None:
        self.font = ImageFont.load_default(size=size)
        self.calls = 0
        self.chars = 0

    def getlength(self, text: str) -> float:
        self.calls += 1
        self.chars += len(text)
        return float(self.font.getlength(text))


def reference_wrap(text: str, font: CountingFont, max_width: float, max_lines: int) -> list[str]:
    """The wrapping as it was first written (quadratic per line): the lines to expect."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}".strip()
        if font.getlength(candidate) <= max_width:
            current = candidate
            continue
        if current:
            lines.append(current)
        current = word
        while font.getlength(current) > max_width and len(current) > 1:
            cut = len(current) - 1
            while cut > 1 and font.getlength(current[:cut]) > max_width:
                cut -= 1
            lines.append(current[:cut])
            current = current[cut:]
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and font.getlength(last + "…") > max_width:
            last = last[:-1]
        lines[-1] = last.rstrip() + "…"
    return lines


PROMPTS = [
    "a red fox in snow",
    "a red fox in snow " * 30,
    "x" * 300,
    "W" * 120 + " tiny " + "i" * 200,
    "a " + "supercalifragilistic" * 8 + " end",
    "moonlit ocean with stars and a very long tail of words " * 6,
    "é" * 50 + " 漢字" * 40,
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(("size", "width", "max_lines"), [(21, 500, 3), (9, 56, 2), (48, 2000, 3)])
def test_wrapping_gives_the_lines_it_always_gave(
    prompt: str, size: int, width: int, max_lines: int
) -> None:
    font = CountingFont(size)
    text = " ".join(prompt.split())
    assert _wrap(text, font, width, max_lines) == reference_wrap(text, font, width, max_lines)  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", ["x" * 2000, "W" * 2000, ("ab" * 40 + " ") * 24])
def test_a_long_prompt_takes_a_bounded_number_of_measurements(prompt: str) -> None:
    # Given the longest prompt the API takes, with and without spaces
    font = CountingFont(21)

    # When it is wrapped for a 512-pixel picture
    lines = _wrap(" ".join(prompt.split()), font, 500, 3)  # type: ignore[arg-type]

    # Then three lines come back, after a small amount of measuring
    assert len(lines) == 3 and lines[-1].endswith("…")
    assert font.calls < 200, font.calls
    assert font.chars < 200 * 100, font.chars
