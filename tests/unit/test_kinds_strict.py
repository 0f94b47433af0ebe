"""Task kinds validate params strictly unless their params model says otherwise."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
import pytest
from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import InvalidRequest
from kiln.kinds import TaskKind


async def _handler(ctx: Any, params: Any) -> None:
    return None


class Plain(BaseModel):
    steps: int = 1
    box: tuple[int, int] | None = None


class Lax(BaseModel):
    model_config = ConfigDict(strict=False)

    steps: int = 1


class StrictButOne(BaseModel):
    model_config = ConfigDict(strict=True)

    steps: int = 1
    seed: Annotated[int, Field(strict=False)] = 0


def kind(model: type[pydantic.BaseModel]) -> TaskKind:
    return TaskKind("test.kind", _handler, params=model)


@pytest.mark.parametrize("value", [True, "3", 3.5, None])
def test_a_kind_is_strict_by_default(value: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"params\.steps"):
        kind(Plain).validate({"steps": value})


def test_json_forms_are_still_taken_in_strict_mode() -> None:
    assert kind(Plain).validate({"steps": 3.0, "box": [1, 2]}) == {"steps": 3, "box": [1, 2]}


def test_a_kind_may_ask_for_lax_parsing() -> None:
    assert kind(Lax).validate({"steps": "3"}) == {"steps": 3}
    assert kind(StrictButOne).validate({"seed": "7"}) == {"steps": 1, "seed": 7}
    with pytest.raises(InvalidRequest, match=r"params\.steps"):
        kind(StrictButOne).validate({"steps": "3"})


def test_params_that_are_not_plain_json_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="plain JSON"):
        kind(Plain).validate({"steps": float("nan")})
    with pytest.raises(InvalidRequest, match="plain JSON"):
        kind(Plain).validate({"steps": object()})


def test_a_kind_without_a_model_still_takes_only_plain_json() -> None:
    free = TaskKind("test.free", _handler)
    assert free.validate({"a": [1, "x", None]}) == {"a": [1, "x", None]}
    with pytest.raises(InvalidRequest, match="plain JSON"):
        free.validate({"a": float("inf")})
