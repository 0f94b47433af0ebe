"""Task kinds: what a registered kind is, and what registering one needs.

A kind is its handler plus the policies the engine applies to its tasks (params model,
resources, timeouts, retry policy, moderation check, inputs). :class:`kiln.App` keeps the
registry; code that adds kinds (:mod:`kiln.demo`, :mod:`kiln.transform`,
:mod:`kiln.backends`) takes any :class:`Registry`, so it never needs the App itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pydantic

from kiln.errors import InvalidRequest, UnknownKind
from kiln.models import JSON, Output, Timeouts

if TYPE_CHECKING:
    from kiln.config import Settings
    from kiln.retry import RetryPolicy
    from kiln.storage import Storage

HandlerResult = Output | Sequence[Output] | None
Handler = Callable[..., Awaitable[HandlerResult]]
ReviewCheck = Callable[[Any, list[Output]], bool | Awaitable[bool]]
#: ``check(params, inputs)``: raises InvalidRequest when the params do not fit the inputs.
InputCheck = Callable[[Any, list[JSON]], None]


@dataclass(frozen=True, slots=True)
class TaskKind:
    """A registered kind of task: its handler and the policies the engine applies to it."""

    name: str
    handler: Handler
    params: type[pydantic.BaseModel] | None = None
    resources: dict[str, int] = field(default_factory=dict)
    timeouts: Timeouts | None = None
    retry: RetryPolicy | None = None
    review: ReviewCheck | None = None
    normalize: Callable[[JSON], JSON] | None = None
    #: Names of the inputs a task of this kind is submitted with (uploaded files).
    inputs: tuple[str, ...] = ()
    check: InputCheck | None = None

    def validate(self, params: Any) -> JSON:
        """Validated, canonical params (defaults applied) as plain JSON."""
        if self.params is None:
            if not isinstance(params, dict):
                raise InvalidRequest("params must be a JSON object")
            return dict(params)
        try:
            model = self.params.model_validate(params)
        except pydantic.ValidationError as exc:
            details = [
                {"loc": ["params", *map(str, err["loc"])], "msg": err["msg"], "type": err["type"]}
                for err in exc.errors()
            ]
            raise InvalidRequest(f"invalid params for {self.name}", details=details) from None
        data: JSON = model.model_dump(mode="json", exclude_none=True)
        return self.normalize(data) if self.normalize else data

    def parse(self, params: JSON) -> Any:
        """The params as the handler takes them: the kind's model, or plain JSON."""
        return params if self.params is None else self.params.model_validate(params)

    def check_inputs(self, params: JSON, inputs: list[JSON]) -> None:
        """Refuse (InvalidRequest) an input this kind does not take or got twice, a missing
        one, and params that do not fit the inputs (``check``)."""
        names = [str(i["name"]) for i in inputs]
        for name in names:
            if name not in self.inputs or names.count(name) > 1:
                why = "twice" if name in self.inputs else f"but {self.name} does not take it"
                detail = {"loc": [name], "msg": "unexpected input", "type": "input"}
                raise InvalidRequest(f"the input {name!r} was sent {why}", details=[detail])
        for name in self.inputs:
            if name not in names:
                detail = {"loc": [name], "msg": "missing input", "type": "input"}
                raise InvalidRequest(
                    f"{self.name} needs the input {name!r}: upload it as a file part of a "
                    "multipart/form-data request",
                    details=[detail],
                )
        if self.check is not None:
            self.check(self.parse(params), inputs)


def find_kind(kinds: dict[str, TaskKind], name: str) -> TaskKind:
    """The registered kind ``name``, or UnknownKind."""
    try:
        return kinds[name]
    except KeyError:
        raise UnknownKind(f"no task kind {name!r} is registered") from None


async def call_review(check_fn: ReviewCheck, params: Any, outputs: list[Output]) -> bool:
    """The moderation verdict of ``check_fn``, awaited when it is a coroutine."""
    verdict = check_fn(params, outputs)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    return bool(verdict)


class Registry(Protocol):
    """What code that registers task kinds uses (:class:`kiln.App` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def storage(self) -> Storage: ...

    @property
    def kinds(self) -> dict[str, TaskKind]: ...

    def task(
        self,
        name: str,
        *,
        params: type[pydantic.BaseModel] | None = None,
        resources: dict[str, int] | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        review: ReviewCheck | None = None,
        normalize: Callable[[JSON], JSON] | None = None,
        inputs: Sequence[str] = (),
        check: InputCheck | None = None,
    ) -> Callable[[Handler], Handler]: ...
