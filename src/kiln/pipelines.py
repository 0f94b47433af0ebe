"""Pipelines as data: the submitted graph, its checks, and what is ready to run.

A pipeline is a task of kind ``pipeline`` whose params list steps; each step is a task of
its own kind, created once the outputs it reads exist (docs/pipelines.md). This module is
pure: :func:`parse` checks the shape of a submission (names, references, order, sizes;
the App checks each step's params with its kind), and :func:`verdict` says, from the
statuses of the steps made so far, which copies to create next and whether the pipeline
ends. The store applies that in the transaction of the step's change
(``kiln.store.pipelines``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pydantic

from kiln.errors import InvalidRequest, KilnError
from kiln.models import JSON, Timeouts
from kiln.states import ENDED_UNSUCCESSFULLY, FINAL, Status

KIND = "pipeline"
#: Steps one pipeline may have, copies one step may have (``repeat``), tasks in all.
MAX_STEPS = 20
MAX_REPEAT = 100
MAX_TASKS = 200
#: What happens when a step fails for good: ``stop`` cancels the steps still pending or
#: running and ends the pipeline at once; ``continue`` lets the steps that do not depend
#: on the failed one finish first.
POLICIES = ("stop", "continue")
WILDCARD = "*"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
REF = re.compile(r"^step:([A-Za-z0-9_-]{1,64})/(\*|[A-Za-z0-9._-]{1,128})$")
STEP_KEYS = {"name", "kind", "params", "inputs", "repeat"}
#: What :func:`plan` adds to a step. A step given with them (the stored params of a
#: pipeline, sent back) is planned anew; they must then be what planning gives, so that
#: nothing sent is silently dropped.
PLANNED_KEYS = {"copies", "timeouts"}

T = TypeVar("T")

#: A copy of a step: (step name, copy index).
Copy = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Ref:
    """An input that names outputs of an earlier step: one output, or all (``*``)."""

    step: str
    output: str

    @property
    def fan_in(self) -> bool:
        return self.output == WILDCARD


def _refuse(message: str, *loc: str | int) -> InvalidRequest:
    detail = {"loc": ["params", *loc], "msg": message, "type": "pipeline"}
    return InvalidRequest(f"invalid pipeline: {message}", details=[detail])


def parse(params: Any) -> list[JSON]:
    """The steps of a pipeline's params, checked for shape (each step's own params are
    its kind's to check): a list of 1 to MAX_STEPS steps with unique names, inputs that
    name outputs of earlier steps (so no cycle), repeats within bounds."""
    if not isinstance(params, dict) or set(params) - {"steps", "on_failure"}:
        raise _refuse("params take steps and on_failure only")
    policy = params.get("on_failure", "stop")
    if policy not in POLICIES:
        raise _refuse(f"on_failure must be one of {', '.join(POLICIES)}", "on_failure")
    steps = params.get("steps")
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_STEPS:
        raise _refuse(f"steps must be a list of 1 to {MAX_STEPS} steps", "steps")
    seen: dict[str, int] = {}
    total = 0
    given = [_unplanned(step) for step in steps]
    for index, step in enumerate(given):
        _check_step(step, index, seen)
        seen[step["name"]] = step.get("repeat", 1)
        total += seen[step["name"]]
    if total > MAX_TASKS:
        raise _refuse(f"a pipeline runs at most {MAX_TASKS} tasks, this one {total}", "steps")
    return given


def _unplanned(step: Any) -> Any:
    if not isinstance(step, dict):
        return step
    return {key: value for key, value in step.items() if key not in PLANNED_KEYS}


def unplanned(params: JSON) -> JSON:
    """A pipeline's stored params without what :func:`plan` added to its steps: the
    params as given, to be planned again (a rerun of it)."""
    steps = params.get("steps")
    if not isinstance(steps, list):
        return dict(params)
    return {**params, "steps": [_unplanned(step) for step in steps]}


def _check_step(step: Any, index: int, seen: Mapping[str, int]) -> None:
    if not isinstance(step, dict):
        raise _refuse(f"a step takes {', '.join(sorted(STEP_KEYS))}", "steps", index)
    unknown = sorted(str(key) for key in set(step) - STEP_KEYS)
    if unknown:
        takes = ", ".join(sorted(STEP_KEYS))
        raise _refuse(f"a step takes {takes}, not {unknown[0]}", "steps", index, unknown[0])
    name, kind = step.get("name"), step.get("kind")
    if not isinstance(name, str) or not NAME.match(name):
        raise _refuse("a step's name is 1 to 64 letters, digits, - or _", "steps", index, "name")
    if name in seen:
        raise _refuse(f"two steps are named {name!r}", "steps", index, "name")
    if not isinstance(kind, str) or kind == KIND:
        raise _refuse("a step's kind names a task kind (not pipeline)", "steps", index, "kind")
    repeat = step.get("repeat", 1)
    if type(repeat) is not int or not 1 <= repeat <= MAX_REPEAT:
        raise _refuse(f"repeat is 1 to {MAX_REPEAT}", "steps", index, "repeat")
    _check_inputs(step.get("inputs", {}), repeat, index, seen)


def _check_inputs(inputs: Any, repeat: int, index: int, seen: Mapping[str, int]) -> None:
    if not isinstance(inputs, dict):
        raise _refuse("inputs map input names to step:NAME/OUTPUT", "steps", index, "inputs")
    for input_name, raw in inputs.items():
        ref = ref_of(raw)
        where = ("steps", index, "inputs", input_name)
        if ref is None:
            raise _refuse(f"{raw!r} is not step:NAME/OUTPUT or step:NAME/*", *where)
        if ref.step not in seen:
            raise _refuse(f"{ref.step!r} is not an earlier step", *where)
        if not ref.fan_in and seen[ref.step] not in (1, repeat):
            raise _refuse(
                f"{ref.step!r} repeats {seen[ref.step]} times: read one copy per copy "
                f"(repeat {seen[ref.step]} here too) or all of them (step:{ref.step}/*)",
                *where,
            )


def ref_of(raw: Any) -> Ref | None:
    found = REF.match(raw) if isinstance(raw, str) else None
    return None if found is None else Ref(found.group(1), found.group(2))


def copies(step: JSON) -> list[Copy]:
    return [(str(step["name"]), i) for i in range(int(step.get("repeat", 1)))]


def key(copy: Copy) -> str:
    """How a copy is named in the pipeline's map of steps: ``name/copy``."""
    return f"{copy[0]}/{copy[1]}"


def sources(step: JSON, copy: int, repeats: Mapping[str, int]) -> list[tuple[str, Copy, str]]:
    """What copy ``copy`` of ``step`` reads: (input name, the copy it reads, output name
    or ``*``), in input order then copy order."""
    found = []
    for input_name, raw in step.get("inputs", {}).items():
        ref = ref_of(raw)
        assert ref is not None  # parse() checked it
        if ref.fan_in:
            found += [(input_name, (ref.step, i), WILDCARD) for i in range(repeats[ref.step])]
        else:
            source = copy if repeats[ref.step] > 1 else 0
            found.append((input_name, (ref.step, source), ref.output))
    return found


def input_records(
    step: JSON, copy: int, repeats: Mapping[str, int], results: Mapping[Copy, JSON]
) -> list[JSON] | str:
    """The input records of a copy whose sources succeeded: each output record with its
    storage key (passed by reference, never copied); or why one is missing."""
    records: list[JSON] = []
    for input_name, source, output in sources(step, copy, repeats):
        outputs = list(results[source].get("outputs", []))
        chosen = outputs if output == WILDCARD else [o for o in outputs if o["name"] == output]
        if not chosen:
            return f"step {key(source)} has no output {output!r}"
        for item in chosen:
            records.append(
                {
                    "name": input_name,
                    "key": item["key"],
                    "sha256": item["sha256"],
                    "size": item["size"],
                    "content_type": item["content_type"],
                }
            )
    return records


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the steps' statuses call for: copies to create, and the pipeline's end
    (None while it runs) with the copies that ended it."""

    create: list[tuple[JSON, int]]
    end: Status | None
    failed: list[Copy]


def verdict(steps: list[JSON], policy: str, statuses: Mapping[Copy, Status]) -> Verdict:
    """Which copies are ready (not made yet, every source SUCCESS), and whether the
    pipeline ends: SUCCESS once every copy succeeded; FAILED (CANCELLED when only
    cancelled steps ended it) once a copy ended without success and, under ``continue``,
    nothing else can run."""
    repeats = {str(s["name"]): int(s.get("repeat", 1)) for s in steps}
    failed = [copy for copy, status in statuses.items() if status in ENDED_UNSUCCESSFULLY]
    create: list[tuple[JSON, int]] = []
    if not failed or policy == "continue":
        for step in steps:
            for name, index in copies(step):
                if (name, index) in statuses:
                    continue
                needed = [source for _, source, _ in sources(step, index, repeats)]
                if all(statuses.get(source) is Status.SUCCESS for source in needed):
                    create.append((step, index))
    active = [c for c, status in statuses.items() if status not in FINAL]
    end: Status | None = None
    total = sum(repeats.values())
    if failed and (policy == "stop" or (not active and not create)):
        cancelled_only = all(statuses[c] is Status.CANCELLED for c in failed)
        end = Status.CANCELLED if cancelled_only else Status.FAILED
    elif not failed and not create and not active and len(statuses) == total:
        end = Status.SUCCESS
    return Verdict(create, end, sorted(failed))


class Shape(pydantic.BaseModel):
    """A pipeline's params before its steps are checked (:func:`plan` does the rest)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    steps: list[dict[str, Any]] = pydantic.Field(
        description='1 to 20 steps in order, each {"name", "kind", "params", "inputs": '
        '{"image": "step:NAME/OUTPUT" or "step:NAME/*"}, "repeat"} (docs/pipelines.md)'
    )
    on_failure: str = pydantic.Field("stop", description="stop or continue")


class StepKind(Protocol):
    """What planning needs of a step's kind (a :class:`kiln.kinds.TaskKind`)."""

    @property
    def inputs(self) -> tuple[str, ...]: ...

    @property
    def timeouts(self) -> Timeouts | None: ...

    def validate(self, params: Any) -> JSON: ...

    def model_of(self, params: JSON) -> str | None: ...

    def batch_key_of(self, params: JSON) -> str | None: ...


#: The output names a step of a kind makes with these params, given the names of the
#: outputs it reads; None when the kind does not say (any name is taken at submit).
OutputsOf = Callable[[str, JSON, list[str]], set[str] | None]
#: ``fits(kind, params, count)``: raises InvalidRequest (``loc`` within the step) when a
#: copy of a step with these (validated) params cannot take ``count`` inputs.
Fits = Callable[[str, JSON, int], None]


def plan(
    params: Any,
    kind_of: Callable[[str], StepKind],
    outputs_of: OutputsOf,
    fits: Fits | None = None,
) -> JSON:
    """The pipeline's params as stored: each step checked by its kind (params, inputs,
    the output names it reads, and with ``fits`` how many inputs a copy reads, when the
    steps it reads say), with its copies (a repeated step's copy ``i`` runs with
    ``seed + i``) and what each copy runs with. InvalidRequest names the first problem."""
    steps = parse(params)
    repeats = {str(s["name"]): int(s.get("repeat", 1)) for s in steps}
    known: dict[str, set[str] | None] = {}
    planned = []
    for index, step in enumerate(steps):
        kind = _kind(kind_of, step, index)
        clean = _validated(kind, step.get("params", {}), index)
        inputs = dict(step.get("inputs", {}))
        if set(inputs) != set(kind.inputs):
            wanted = ", ".join(kind.inputs) or "none"
            raise _refuse(f"{step['kind']} takes the inputs: {wanted}", "steps", index, "inputs")
        read = _read_names(inputs, known, index)
        count = _read_count(inputs, known, repeats)
        if fits is not None and count is not None:
            _in_step(functools.partial(fits, str(step["kind"]), clean, count), index)
        known[step["name"]] = outputs_of(step["kind"], clean, read)
        repeat = int(step.get("repeat", 1))
        mapped = any(_maps(raw, repeat, steps) for raw in inputs.values())
        runs = [clean] if repeat == 1 else _seeded(kind, clean, repeat, index, mapped)
        timeouts = kind.timeouts or Timeouts()
        planned.append(
            {
                "name": step["name"],
                "kind": step["kind"],
                "params": clean,
                "inputs": inputs,
                "repeat": repeat,
                "copies": [
                    {"params": p, "model": kind.model_of(p), "batch_key": kind.batch_key_of(p)}
                    for p in runs
                ],
                "timeouts": [timeouts.waiting_s, timeouts.generating_s, timeouts.uploading_s],
            }
        )
        _check_planned(params["steps"][index], planned[-1], index)
    return {"steps": planned, "on_failure": params.get("on_failure", "stop")}


def _check_planned(given: JSON, planned: JSON, index: int) -> None:
    """A step sent with ``copies`` or ``timeouts`` (its stored form sent back) must have
    them as planned: a changed value is refused, never silently replaced."""
    for key in sorted(PLANNED_KEYS & set(given)):
        if given[key] != planned[key]:
            why = (
                f"{key} is what kiln planned for the step from its params and repeat: "
                "leave it out, or send it as the stored params show it"
            )
            raise _refuse(why, "steps", index, key)


def _kind(kind_of: Callable[[str], StepKind], step: JSON, index: int) -> StepKind:
    try:
        return kind_of(str(step["kind"]))
    except KilnError:
        raise _refuse(f"unknown kind {step['kind']!r}", "steps", index, "kind") from None


def _validated(kind: StepKind, params: Any, index: int) -> JSON:
    return _in_step(lambda: kind.validate(params), index)


def _in_step(check: Callable[[], T], index: int) -> T:
    """``check()``, its InvalidRequest's ``loc`` placed within step ``index``."""
    try:
        return check()
    except InvalidRequest as exc:
        details = [
            {**d, "loc": ["params", "steps", index, *d.get("loc", ["params"])]}
            for d in exc.details or []
        ]
        message = f"invalid pipeline step {index}: {exc.message}"
        raise InvalidRequest(message, details=details) from None


def _read_names(inputs: JSON, known: Mapping[str, set[str] | None], index: int) -> list[str]:
    """The output names a step reads; an output its source does not make is refused."""
    names: list[str] = []
    for input_name, raw in inputs.items():
        ref = ref_of(raw)
        assert ref is not None
        made = known[ref.step]
        if ref.fan_in:
            names += sorted(made or ())
        elif made is not None and ref.output not in made:
            where = ("steps", index, "inputs", input_name)
            raise _refuse(f"step {ref.step!r} makes {', '.join(sorted(made))}", *where)
        else:
            names.append(ref.output)
    return names


def _read_count(
    inputs: JSON, known: Mapping[str, set[str] | None], repeats: Mapping[str, int]
) -> int | None:
    """How many input records each copy of a step reads: one per plain reference, every
    output of every copy per fan-in; None when a fan-in reads a step whose outputs are not
    known at submit."""
    count = 0
    for raw in inputs.values():
        ref = ref_of(raw)
        assert ref is not None
        made = known[ref.step]
        if not ref.fan_in:
            count += 1
        elif made is None:
            return None
        else:
            count += len(made) * repeats[ref.step]
    return count


def _maps(raw: Any, repeat: int, steps: list[JSON]) -> bool:
    """Whether an input reads one copy of a repeated step per copy (copy i reads copy i)."""
    ref = ref_of(raw)
    source = next(s for s in steps if ref is not None and s["name"] == ref.step)
    return ref is not None and not ref.fan_in and int(source.get("repeat", 1)) == repeat


def _seeded(kind: StepKind, clean: JSON, repeat: int, index: int, mapped: bool) -> list[JSON]:
    """The params of each copy: ``seed + i`` when the kind takes a seed; the same params
    when each copy reads its own input (copy i of a step repeated as often)."""
    seed = clean.get("seed")
    if type(seed) is not int:
        if mapped:
            return [clean] * repeat
        why = "repeat needs a kind whose params have a seed, or an input read copy by copy"
        raise _refuse(why, "steps", index, "repeat")
    return [_validated(kind, {**clean, "seed": seed + i}, index) for i in range(repeat)]
