"""kiln: a durable job engine for AI generation work."""

from kiln.app import App
from kiln.client import AsyncClient, Client
from kiln.config import Settings
from kiln.errors import KilnError, LeaseLost, Permanent, Retryable, TaskError, Yielded
from kiln.kinds import BatchPolicy, TaskKind
from kiln.models import Output, Task, TaskEvent, Timeouts
from kiln.retry import RetryPolicy
from kiln.states import Event, Status

__all__ = [
    "App",
    "AsyncClient",
    "BatchPolicy",
    "Client",
    "Event",
    "KilnError",
    "LeaseLost",
    "Output",
    "Permanent",
    "RetryPolicy",
    "Retryable",
    "Settings",
    "Status",
    "Task",
    "TaskError",
    "TaskEvent",
    "TaskKind",
    "Timeouts",
    "Yielded",
]
