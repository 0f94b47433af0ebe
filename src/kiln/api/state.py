"""What the routes share: the kiln App, the settings in force, metrics, single-flight (of
:class:`Submitted` answers), the encoded events of the streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import HTTPConnection

from kiln.api.metrics import ApiMetrics
from kiln.api.recent import RecentContent
from kiln.api.singleflight import SingleFlight
from kiln.api.sse import EncodedEvents
from kiln.app import App
from kiln.app_parts import PoolWait
from kiln.config import Settings
from kiln.models import SubmitResult, Task


@dataclass(frozen=True, slots=True)
class Standing:
    """A task with where it stands: its place in the queue and in a shared pool's line."""

    task: Task
    queue_position: int | None
    resource_wait: PoolWait | None
    #: A pipeline's steps made so far, by ``name/copy`` (None for every other task).
    steps: dict[str, Task] | None = None
    #: Its answer's JSON by the ``deduplicated`` flag, once rendered: the copies of a
    #: submission answered together (single-flight) share one rendering.
    rendered: dict[bool, bytes] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Submitted:
    """A submission's outcome, and where its task stood when the store answered."""

    result: SubmitResult
    standing: Standing


@dataclass(slots=True)
class ApiState:
    app: App
    settings: Settings
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    submissions: SingleFlight[Submitted] = field(default_factory=SingleFlight)
    #: Content keys seen lately: a submission of one reads before it writes.
    recent_content: RecentContent = field(default_factory=RecentContent)
    encoded_events: EncodedEvents = field(default_factory=EncodedEvents)
    ping_interval_s: float = 15.0


def api_state(connection: HTTPConnection) -> ApiState:
    """The state of the FastAPI app serving this request or socket."""
    state: ApiState = connection.app.state.kiln
    return state
