"""Canonical forms: request fingerprints, dedup keys and task ids."""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from typing import Any

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


#: ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``, made
#: once (``json.dumps`` with options builds an encoder on every call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> str:
    """One byte-exact JSON text per value: sorted keys, no spaces, UTF-8."""
    return _CANONICAL.encode(value)


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def request_fingerprints(
    body: dict[str, Any], *, older: bool = True
) -> tuple[str, tuple[str, ...]]:
    """The ``Idempotency-Key`` fingerprint of a submission's ``body`` (``deadline_s`` and
    ``timeouts`` in it), and the older fingerprints that still match it.

    Numbers are fingerprinted in one form, as floats, so a default given explicitly
    (``"deadline_s": 86400``) matches the default left out, whichever way the request came
    (``POST /v1/tasks`` or a batch item). Keys stored before kept the body as it came: a
    ``deadline_s`` left out was the integer 86400, one given a float (timeouts were
    floats either way). The body as given and with a whole ``deadline_s`` as an integer
    are those older forms (computed only with ``older``: a request without a key needs
    none)."""
    deadline_s, timeouts = body["deadline_s"], [float(t) for t in body["timeouts"]]
    main = digest({**body, "deadline_s": float(deadline_s), "timeouts": timeouts})
    if not older:
        return main, ()
    found = [digest(body), digest({**body, "deadline_s": _whole(deadline_s)})]
    return main, tuple(dict.fromkeys(d for d in found if d != main))


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def dedup_key(kind: str, params: dict[str, Any], input_hashes: list[str]) -> str:
    """Same kind, same canonical params and same input bytes: same work."""
    return digest({"kind": kind, "params": params, "inputs": sorted(input_hashes)})


class _IdClock:
    """Time-ordered ids: 48 bits of milliseconds then 80 bits, monotonic in a process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0
        # Seeded once from the OS: reading os.urandom per id costs tens of microseconds
        # here, and ids need uniqueness, not secrecy.
        self._random = random.Random(os.urandom(32))

    def next(self) -> int:
        with self._lock:
            value = (int(time.time() * 1000) << 80) | self._random.getrandbits(80)
            if value <= self._last:
                value = self._last + 1
            self._last = value
            return value


_ids = _IdClock()


#: Every two Crockford digits, by the 10 bits they write.
_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)


def new_id(prefix: str) -> str:
    """``prefix`` and 26 Crockford base-32 digits of a 128-bit time-ordered value (130
    bits written, the first two zero), ten bits at a time."""
    v, p = _ids.next(), _PAIRS
    digits = (
        p[v >> 120], p[v >> 110 & 1023], p[v >> 100 & 1023], p[v >> 90 & 1023],
        p[v >> 80 & 1023], p[v >> 70 & 1023], p[v >> 60 & 1023], p[v >> 50 & 1023],
        p[v >> 40 & 1023], p[v >> 30 & 1023], p[v >> 20 & 1023], p[v >> 10 & 1023],
        p[v & 1023],
    )  # fmt: skip
    return prefix + "".join(digits)


def new_task_id() -> str:
    return new_id("tsk_")
