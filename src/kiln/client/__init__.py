"""HTTP clients for kiln's API: :class:`Client` (sync) and :class:`AsyncClient`.

Both faces share everything but the sending: :class:`Call` describes a request and how its
answer is read, :func:`error_from_response` turns an error envelope into the matching
:class:`~kiln.errors.KilnError`, and :class:`SSEDecoder` with :class:`Follow` parse and
resume a task's event stream.

The package: ``clients`` (the two faces, side by side), ``calls`` (the requests),
``responses`` (answers and error envelopes), ``events`` (the event stream) and ``uploads``
(inputs by reference or as files). Every public name is importable from ``kiln.client``.

>>> with kiln.Client("http://127.0.0.1:8000", api_key="...") as client:
...     task = client.submit(params={"prompt": "a red fox"})
...     done = client.wait(task["id"])
"""

from kiln.client.calls import (
    SCHEDULES_PATH,
    BulkAsk,
    Call,
    batch_call,
    list_call,
    redeliver_call,
    rerun_call,
    review_call,
    schedule_create_call,
    schedule_list_call,
    schedule_path,
    submit_call,
    usage_call,
)
from kiln.client.clients import DEFAULT_SERVER, DEFAULT_TIMEOUT_S, AsyncClient, Client
from kiln.client.events import DEADLINE_TICK_S, STREAM_READ_S, STREAM_RETRIES, Follow, SSEDecoder
from kiln.client.responses import (
    ERROR_CLASSES,
    JSON,
    STATUS_CLASSES,
    ConnectionFailed,
    connection_failed,
    error_from_response,
    read_bytes,
    read_json,
    read_submitted,
)
from kiln.client.uploads import REFERENCE_PREFIX, input_reference, multipart_parts

__all__ = [
    "DEADLINE_TICK_S",
    "DEFAULT_SERVER",
    "DEFAULT_TIMEOUT_S",
    "ERROR_CLASSES",
    "JSON",
    "REFERENCE_PREFIX",
    "SCHEDULES_PATH",
    "STATUS_CLASSES",
    "STREAM_READ_S",
    "STREAM_RETRIES",
    "AsyncClient",
    "BulkAsk",
    "Call",
    "Client",
    "ConnectionFailed",
    "Follow",
    "SSEDecoder",
    "batch_call",
    "connection_failed",
    "error_from_response",
    "input_reference",
    "list_call",
    "multipart_parts",
    "read_bytes",
    "read_json",
    "read_submitted",
    "redeliver_call",
    "rerun_call",
    "review_call",
    "schedule_create_call",
    "schedule_list_call",
    "schedule_path",
    "submit_call",
    "usage_call",
]
