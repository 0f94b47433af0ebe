"""The command line's groundwork: the ``kiln`` Typer app, how a command turns kiln's
errors into a message and an exit code, and the options every command shares."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer

import kiln
from kiln import backends, config, logs, transform
from kiln.backends import comfy_workflow
from kiln.cli import task_io as tasks
from kiln.client import Client
from kiln.config import Settings
from kiln.errors import KilnError

if TYPE_CHECKING:
    pass


P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("kiln.cli")

JSON = dict[str, Any]

cli = typer.Typer(
    name="kiln",
    help="kiln: a durable job engine for AI generation work.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: a flag shows as `--wait`, not `--wait <bool>`
    context_settings={"max_content_width": 120},  # as wide as the terminal, up to 120
)

#: Errors that mean "you asked wrongly or cannot get in": exit 2.
USAGE_CODES = frozenset(
    {
        "config_error",
        "connection_failed",
        "store_unavailable",
        "storage_error",
        "unauthorized",
        "forbidden",
        "invalid_request",
        "unknown_kind",
    }
)


@cli.callback()
def _root() -> None:
    """kiln: a durable job engine for AI generation work."""


def main() -> None:
    """The console script."""
    cli()


def exit_code(exc: KilnError) -> int:
    status = getattr(exc, "status_code", None)
    if exc.code in USAGE_CODES or status in (401, 403, 422):
        return 2
    return 1


def handled(func: Callable[P, R]) -> Callable[P, R]:
    """Turn kiln's errors into a one-line message on stderr and the API.md exit code."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except KilnError as exc:
            for line in tasks.error_lines(exc):
                typer.echo(line, err=True)
            raise typer.Exit(exit_code(exc)) from None

    return wrapper


# shared options


def option(field: str, *flags: str, **extra: Any) -> Any:
    """A typer option mirroring the setting ``field``: help, variable and default come
    from the table. It reads only the command line; the table reads the environment."""
    var = config.variable(field)
    meaning = re.sub(r" \(`[^`]*--[a-z-]+`\)", "", var.help)  # the flag is shown anyway
    shown = f"{meaning} [env {var.name}; default {var.default_text}]".replace("`", "")
    return typer.Option(*flags, help=shown, show_default=False, **extra)


def port_text(raw: str) -> int | str:
    """A port option's text: the port when it is one, else the text as given, refused by
    :func:`port_of` in the command with one line (a parse error here would be a usage
    block)."""
    try:
        port = config.PORT(raw)
    except ValueError:
        return raw
    assert isinstance(port, int)
    return port


Server = Annotated[str | None, option("server", "--server")]
ApiKey = Annotated[str | None, option("api_key", "--api-key")]
DataDir = Annotated[Path | None, option("data_dir", "--data-dir")]
DatabaseUrl = Annotated[str | None, option("database_url", "--database-url")]
StorageUrl = Annotated[str | None, option("storage_url", "--storage-url")]
MetricsPort = Annotated[
    int | None, option("metrics_port", "--metrics-port", metavar="PORT", parser=port_text)
]
MetricsHost = Annotated[str | None, option("metrics_host", "--metrics-host")]
Gpus = Annotated[int | None, option("gpus", "--gpus", min=0)]


def settings_of(**overrides: Any) -> Settings:
    """Settings from the environment, then the options that were given (not None)."""
    settings = Settings.from_env()
    return settings.with_(**{k: v for k, v in overrides.items() if v is not None})


def port_of(field: str, flag: str, raw: int | str | None) -> int | None:
    """A port option as its setting reads it (digits only: ``+80`` is refused, as in the
    variable), None when not given; ConfigError naming the option otherwise."""
    if raw is None or isinstance(raw, int):
        return raw
    var = config.variable(field)
    try:
        value = var.parse(raw)
    except ValueError:
        raise var.refusal(flag, raw) from None
    assert isinstance(value, int)
    return value


def client_of(server: str | None, api_key: str | None) -> Client:
    """A client on ``--server`` / ``--api-key``, else KILN_SERVER / KILN_API_KEY."""
    settings = Settings.from_env(only=("server", "api_key"))
    return Client(server or settings.server, api_key or settings.api_key)


def kind_names(raw: str | None) -> tuple[str, ...] | None:
    """``--kinds a,b`` as names; None when not given (or naming none)."""
    names = tuple(k.strip() for k in (raw or "").split(",") if k.strip())
    return names or None


def with_builtin_kinds(app: kiln.App) -> kiln.App:
    """``app`` with the kinds every kiln process registers: what `kiln serve` accepts and
    its OpenAPI document describes."""
    backends.register(app)  # image.generate on KILN_BACKEND (the demo by default)
    transform.register(app)  # image.transform, image.contact_sheet
    comfy_workflow.register(app)  # claimed only by workers that name it (--kinds)
    return app


def app_of(settings: Settings) -> kiln.App:
    """An App with the built-in kinds (nothing opened yet), logging as the settings say."""
    logs.setup(fmt=settings.log_format, level=settings.log_level)
    return with_builtin_kinds(kiln.App(settings=settings))
