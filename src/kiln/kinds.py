"""Task kinds: what a registered kind is, and what registering one needs.

A kind is its handler plus the policies the engine applies to its tasks (params model,
resources, timeouts, retry policy, moderation check, inputs). :class:`kiln.App` keeps the
registry; code that adds kinds (:mod:`kiln.demo`, :mod:`kiln.transform`,
:mod:`kiln.backends`) takes any :class:`Registry`, so it never needs the App itself.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pydantic

from kiln.canonical import digest
from kiln.errors import InvalidRequest, UnknownKind
from kiln.models import JSON, Output, Timeouts

if TYPE_CHECKING:
    from kiln.config import Settings
    from kiln.retry import RetryPolicy
    from kiln.storage import Storage

HandlerResult = Output | Sequence[Output] | None
#: The longest model name a task may need.
MODEL_NAME_MAX = 200
#: ``TaskKind.inputs`` of a kind that takes inputs of any name (none required).
ANY_INPUTS = "*"
Handler = Callable[..., Awaitable[HandlerResult]]
ReviewCheck = Callable[[Any, list[Output]], bool | Awaitable[bool]]
#: ``check(params, inputs)``: raises InvalidRequest when the params do not fit the inputs.
InputCheck = Callable[[Any, list[JSON]], None]
#: The model a task needs, from its validated params (None: it names none).
ModelOf = Callable[[JSON], "str | None"]
#: How much of each pool a task takes, from its validated params (``{"gpu-mem": 12}``).
AmountsOf = Callable[[JSON], Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """Durable dynamic batching of a kind (docs/scheduling.md): a worker that claims one
    of its tasks claims up to ``max_size`` ready tasks with the same ``key`` params,
    waiting at most ``max_wait_ms`` for more to come, and calls the handler once with all
    of them: ``handler(ctxs, params)`` returns one result (outputs, or an exception that
    fails that task alone) per task, in order."""

    max_size: int
    max_wait_ms: float = 0.0
    #: The params that must match for tasks to share a call (``("model", "width")``).
    key: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_size < 1 or not 0 <= self.max_wait_ms <= 60_000:
            raise ValueError("a batch takes 1 or more tasks and waits 0 to 60,000 ms")

    def key_of(self, params: JSON) -> str:
        """The batch a task with these params may join."""
        return digest({name: params.get(name) for name in self.key})[:32]


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
    #: Names of the inputs a task of this kind is submitted with (uploaded files);
    #: ``(ANY_INPUTS,)``: any uniquely named inputs, none required.
    inputs: tuple[str, ...] = ()
    check: InputCheck | None = None
    #: Which model a task needs (warm-model routing, docs/scheduling.md): the name of a
    #: string param, or a function of the validated params.
    model: str | ModelOf | None = None
    #: How much of each pool a task takes, from its params (memory admission); on top of
    #: ``resources`` (and under KILN_KIND_RESOURCES, which names fixed amounts).
    amounts: AmountsOf | None = None
    #: Tasks of this kind run in batches: the handler takes lists (:class:`BatchPolicy`).
    batch: BatchPolicy | None = None

    def needs_of(self, params: JSON, declared: Mapping[str, int]) -> dict[str, int]:
        """What a task with these params takes: ``declared`` (the kind's resources with
        KILN_KIND_RESOURCES on top) with its own amounts over them."""
        if self.amounts is None:
            return dict(declared)
        own = {name: int(n) for name, n in self.amounts(params).items() if int(n) > 0}
        return {**declared, **own}

    def model_of(self, params: JSON) -> str | None:
        """The model a task with these (validated) params needs, or None."""
        if self.model is None:
            return None
        found = params.get(self.model) if isinstance(self.model, str) else self.model(params)
        if found is None:
            return None
        name = str(found)
        if not name or len(name) > MODEL_NAME_MAX:
            raise InvalidRequest(
                f"the model a {self.name} task needs must be 1 to {MODEL_NAME_MAX} characters"
            )
        return name

    def validate(self, params: Any) -> JSON:
        """Validated, canonical params (defaults applied) as plain JSON.

        Validation is strict, as JSON sees types: no bool for a number, no string for a
        number, no number for a string (an integral number such as ``30.0`` is the
        integer 30). A kind whose params model sets ``strict`` in its own config (and
        ``Field(strict=False)`` on a field) decides for itself."""
        text = _plain_json(params)
        if self.params is None:
            if not isinstance(params, dict):
                raise InvalidRequest("params must be a JSON object")
            return dict(params)
        own = self.params.model_config.get("strict")
        try:
            model = self.params.model_validate_json(text, strict=True if own is None else None)
        except pydantic.ValidationError as exc:
            raise self._refusal(exc) from None
        data: JSON = model.model_dump(mode="json", exclude_none=True)
        return self.normalize(data) if self.normalize else data

    def _refusal(self, exc: pydantic.ValidationError) -> InvalidRequest:
        """InvalidRequest naming each bad field (``params.steps: ...``)."""
        details = [
            {"loc": ["params", *map(str, err["loc"])], "msg": err["msg"], "type": err["type"]}
            for err in exc.errors()
        ]
        named = "; ".join(f"{'.'.join(d['loc'])}: {d['msg']}" for d in details[:3])
        more = f" (and {len(details) - 3} more)" if len(details) > 3 else ""
        return InvalidRequest(f"invalid params for {self.name}: {named}{more}", details=details)

    def batch_key_of(self, params: JSON) -> str | None:
        """The batch a task with these (validated) params may join, or None."""
        return None if self.batch is None else self.batch.key_of(params)

    def parse(self, params: JSON) -> Any:
        """The params as the handler takes them: the kind's model, or plain JSON."""
        return params if self.params is None else self.params.model_validate(params)

    def check_inputs(self, params: JSON, inputs: list[JSON]) -> None:
        """Refuse (InvalidRequest) an input this kind does not take or got twice, a missing
        one, and params that do not fit the inputs (``check``)."""
        names = [str(i["name"]) for i in inputs]
        for name in names:
            taken = name in self.inputs or ANY_INPUTS in self.inputs
            if not taken or names.count(name) > 1:
                why = "twice" if taken else f"but {self.name} does not take it"
                detail = {"loc": [name], "msg": "unexpected input", "type": "input"}
                raise InvalidRequest(f"the input {name!r} was sent {why}", details=[detail])
        for name in self.inputs:
            if name not in names and name != ANY_INPUTS:
                detail = {"loc": [name], "msg": "missing input", "type": "input"}
                raise InvalidRequest(
                    f"{self.name} needs the input {name!r}: upload it as a file part of a "
                    "multipart/form-data request",
                    details=[detail],
                )
        if self.check is not None:
            self.check(self.parse(params), inputs)


def _integral(value: Any) -> Any:
    """JSON has one number type: ``30.0`` is the integer 30 (as JSON Schema says)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_integral(item) for item in value]
    return value


#: ``json.dumps(value, allow_nan=False)``, its encoder made once.
_STRICT = json.JSONEncoder(allow_nan=False)


def _plain_json(params: Any) -> str:
    """``params`` as JSON text, or InvalidRequest when they are not plain, finite JSON."""
    try:
        return _STRICT.encode(_integral(params))
    except (TypeError, ValueError, RecursionError):
        raise InvalidRequest(
            "params must be plain JSON: objects, arrays, strings, finite numbers, "
            "true, false and null",
            details=[{"loc": ["params"], "msg": "not plain JSON", "type": "json_invalid"}],
        ) from None


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
        model: str | ModelOf | None = None,
        amounts: AmountsOf | None = None,
        batch: BatchPolicy | None = None,
    ) -> Callable[[Handler], Handler]: ...
