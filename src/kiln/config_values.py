"""How the text of a ``KILN_*`` variable becomes a value, and what it should look like.

A :class:`Parser` pairs a conversion with ``expected``, the words that finish a refusal
(``KILN_LEASE_TTL_S='abc': expected a number of seconds > 0``). A conversion raises
ValueError, with a reason or none, when the text does not fit. Nothing here reads the
environment: :mod:`kiln.config` does.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.limits import Rate, parse_kind_resources, parse_pools, parse_tenant_limits

RESERVED_TENANTS = frozenset({"admin"})
OUTPUT_URL_MODES = ("proxy", "presigned")
MAX_PRESIGN_TTL_S = 7 * 24 * 3600.0  # the longest S3 signature version 4 allows
DIFFUSERS_DEVICES = ("auto", "cpu", "cuda")
CLAIM_ORDERS = ("fifo", "fair")
BREAKER_POLICIES = ("pause", "fail_fast")
RESULT_LOST_POLICIES = ("rerun", "fail")
FLAG_VALUES = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


@dataclass(frozen=True, slots=True)
class Parser:
    """Turns a variable's text into its value; ``expected`` says what the text should be."""

    expected: str
    convert: Callable[[str], object]

    def __call__(self, raw: str) -> object:
        return self.convert(raw)


def text_of(value: object) -> str:
    """A value as the docs and ``kiln settings`` write it (the form its parser reads)."""
    if value is None or value == {} or value == ():
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else str(value)
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    if isinstance(value, Rate):
        return f"{text_of(value.per_s)}/{text_of(value.burst)}"
    return str(value)


def _g(bound: float) -> str:
    return text_of(float(bound))


def number(
    what: str,
    *,
    above: float | None = None,
    least: float | None = None,
    most: float | None = None,
    whole: bool = False,
    note: str = "",
) -> Parser:
    """A number within bounds: ``above`` (exclusive), ``least`` and ``most`` (inclusive);
    ``note`` says what a special value means."""
    bounds = [f"> {_g(above)}"] if above is not None else []
    bounds += [f">= {_g(least)}"] if least is not None else []
    bounds += [f"<= {_g(most)}"] if most is not None else []
    expected = f"{what} {' and '.join(bounds)}".strip() + (f" ({note})" if note else "")

    def convert(raw: str) -> float | int:
        value = float(raw.strip()) if _is_number(raw) else math.nan
        fits = math.isfinite(value) and (not whole or value.is_integer())
        fits = fits and (above is None or value > above) and (least is None or value >= least)
        if not fits or (most is not None and value > most):
            raise ValueError("")
        return int(value) if whole else value

    return Parser(expected, convert)


def port() -> Parser:
    """A TCP port, 0 to 65535, in plain decimal digits: ``+80``, ``80.0`` or ``8e1``,
    which a number would take, are refused (no server or client writes a port so)."""

    def convert(raw: str) -> int:
        digits = raw.strip()
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 5:
            raise ValueError("")
        value = int(digits)
        if value > 65535:
            raise ValueError("")
        return value

    return Parser("a port number >= 0 and <= 65535", convert)


def choice(*options: str, upper: bool = False) -> Parser:
    """One of ``options``, in any case (kept lower, or upper with ``upper``)."""
    expected = f"{', '.join(options[:-1])} or {options[-1]}" if len(options) > 1 else options[0]

    def convert(raw: str) -> str:
        value = raw.strip().upper() if upper else raw.strip().lower()
        if value not in options:
            raise ValueError("")
        return value

    return Parser(expected, convert)


def flag() -> Parser:
    """1/true/yes/on or 0/false/no/off."""

    def convert(raw: str) -> bool:
        try:
            return FLAG_VALUES[raw.strip().lower()]
        except KeyError:
            raise ValueError("") from None

    return Parser("1 or 0 (true/false, yes/no, on/off)", convert)


def text(*, lower: bool = False) -> Parser:
    """Any text (a URL, a name, a key); ``lower`` folds it to lower case."""
    return Parser("some text", lambda raw: raw.strip().lower() if lower else raw)


#: The prefix of a Standard Webhooks secret: the key follows, in base64.
WHSEC_PREFIX = "whsec_"


def webhook_key(secret: str) -> bytes:
    """The HMAC key of the Standard Webhooks signature (``webhook-signature``): the
    base64-decoded text after ``whsec_`` for a secret in that form (padding optional),
    else the secret's own UTF-8 bytes. ValueError for a ``whsec_`` secret whose rest is
    not base64 (the reason never repeats the secret)."""
    if not secret.startswith(WHSEC_PREFIX):
        return secret.encode("utf-8")
    encoded = secret[len(WHSEC_PREFIX) :]
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not key:
        raise ValueError("the text after whsec_ is not a non-empty base64 key")
    return key


def webhook_secret() -> Parser:
    """A webhook secret: any text, but one starting ``whsec_`` must carry base64 after it."""

    def convert(raw: str) -> str:
        webhook_key(raw)
        return raw

    return Parser("some text (whsec_ followed by base64, or any other text)", convert)


def key_refusal(key: str) -> str | None:
    """Why ``key`` cannot be an API key (blank, spaces, invisible characters), or None."""
    if not key.strip():
        return "it is blank"
    if any(c.isspace() for c in key):
        return "it holds a space"
    if not key.isprintable():
        return "it holds an invisible or control character"
    return None


def key() -> Parser:
    """An API key: printable characters, no spaces (a blank one would let a blank token in).

    Reasons never repeat the key: a refusal is printed."""

    def convert(raw: str) -> str:
        reason = key_refusal(raw)
        if reason is not None:
            raise ValueError(reason)
        return raw

    return Parser("a key of printable characters without spaces", convert)


def path() -> Parser:
    return Parser("a path", Path)


def names() -> Parser:
    """Comma-separated names; at least one."""

    def convert(raw: str) -> tuple[str, ...]:
        found = tuple(name.strip() for name in raw.split(",") if name.strip())
        if not found:
            raise ValueError("")
        return found

    return Parser("comma-separated names", convert)


def structured(expected: str, convert: Callable[[str], object]) -> Parser:
    return Parser(expected, convert)


def _limits(which: str, raw: str) -> object:
    if which == "pools":
        return parse_pools(raw)
    if which == "kind_resources":
        return parse_kind_resources(raw)
    if which == "tenant_limits":
        return parse_tenant_limits(raw)
    return Rate.parse(raw, name="rate")


def limits_parser(expected: str, which: str) -> Parser:
    """One of :mod:`kiln.limits`' formats; its own message is replaced by ``expected``."""

    def convert(raw: str) -> object:
        try:
            return _limits(which, raw)
        except KilnError:
            raise ValueError("") from None

    return Parser(expected, convert)


def _pairs(raw: str, sep: str) -> list[tuple[str, str, str]]:
    """``a<sep>b,c<sep>d`` → [(entry, a, b), ...]; ValueError naming a malformed entry."""
    found = []
    for item in raw.split(","):
        if not item.strip():
            continue
        left, found_sep, right = (part.strip() for part in item.partition(sep))
        if not found_sep or not left or not right:
            raise ValueError(f"entry {item.strip()!r} is not of that form")
        found.append((item.strip(), left, right))
    return found


def parse_api_keys(raw: str) -> dict[str, str]:
    """``tenant:key,tenant:key`` → {key: tenant}. The tenant name ``admin`` is reserved.

    Reasons never repeat a key: a refusal is printed.
    """
    keys: dict[str, str] = {}
    for number_, item in enumerate(raw.split(","), start=1):
        tenant, sep, key = (part.strip() for part in item.partition(":"))
        if not item.strip():
            continue
        if not sep or not tenant or not key:
            raise ValueError(f"entry {number_} is not tenant:key")
        if key_refusal(key) is not None:
            raise ValueError(f"the key of entry {number_} is not usable: {key_refusal(key)}")
        if tenant in RESERVED_TENANTS:
            raise ValueError(f"{tenant!r} is a reserved tenant")
        if key in keys:
            raise ValueError("it lists the same key twice")
        keys[key] = tenant
    return keys


def parse_retention(raw: str) -> dict[str, float]:
    """``tenant:seconds,tenant:seconds`` → {tenant: seconds}; 0 keeps a tenant's tasks."""
    found: dict[str, float] = {}
    for item, tenant, seconds in _pairs(raw, ":"):
        value = float(seconds) if _is_number(seconds) else -1.0
        if value < 0:
            raise ValueError(f"entry {item!r} is not tenant:seconds")
        found[tenant] = value
    return found


def _is_number(raw: str) -> bool:
    try:
        return math.isfinite(float(raw))
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class MemoryRule:
    """What an ``image.generate`` task takes of a pool of memory (GiB):
    ``ceil(base_gb + per_mpx_gb * width * height / 1e6)`` units of ``pool``."""

    pool: str
    base_gb: float
    per_mpx_gb: float = 0.0

    def units(self, width: int, height: int) -> int:
        return max(1, math.ceil(self.base_gb + self.per_mpx_gb * width * height / 1e6 - 1e-9))


def parse_memory_rule(raw: str) -> MemoryRule:
    """``pool:base`` or ``pool:base+per/mpx`` (GiB) → :class:`MemoryRule`."""
    pool, sep, amounts = raw.strip().partition(":")
    if not sep or not pool.strip() or "," in pool:
        raise ValueError("no pool name")
    base, plus, per = amounts.partition("+")
    if plus and not per.strip().endswith("/mpx"):
        raise ValueError("the per-picture part must end in /mpx")
    base_gb = float(base)
    per_gb = float(per.strip()[: -len("/mpx")]) if plus else 0.0
    if not (math.isfinite(base_gb) and math.isfinite(per_gb)) or base_gb < 0 or per_gb < 0:
        raise ValueError("amounts must be finite and not negative")
    if base_gb == 0 and per_gb == 0:
        raise ValueError("a task must take something")
    return MemoryRule(pool.strip(), base_gb, per_gb)


def parse_batch(raw: str) -> tuple[int, float]:
    """``size`` or ``size/wait_ms`` → (max size, max wait in ms)."""
    size, slash, wait = raw.strip().partition("/")
    try:
        count, wait_ms = int(size), float(wait) if slash else 0.0
    except ValueError:
        raise ValueError("not numbers") from None
    if count < 1 or count > 256:
        raise ValueError("the size must be 1 to 256")
    if not math.isfinite(wait_ms) or not 0 <= wait_ms <= 60_000:
        raise ValueError("the wait must be 0 to 60000 ms")
    return count, wait_ms


def parse_breaker_policy(raw: str) -> dict[str, str]:
    """``kind=pause,kind=fail_fast`` → {kind: policy}; ``*`` names every kind not listed."""
    found: dict[str, str] = {}
    for item, kind, policy in _pairs(raw, "="):
        if policy.lower() not in BREAKER_POLICIES:
            raise ValueError(f"entry {item!r} names no policy")
        found[kind] = policy.lower()
    return found
