"""The ``kiln`` command line: processes (serve, worker, supervisor) and API commands.

Exit codes (API.md): 0 when the command did what it says (for ``submit --wait`` and
``watch``: the task ended SUCCESS); 1 when the task ended otherwise or the server refused
(404, 409); 2 for usage, connection and authentication errors, with a one-line message on
stderr and no traceback. A setting kiln cannot use (a ``KILN_*`` variable or an option)
is such a usage error, for every command: ``kiln: KILN_PORT='x': expected a port number ...``.

Options that mirror a setting take their help, their environment variable and their
default from :data:`kiln.config.VARIABLES`; the table alone reads the environment.

The processes start safely: ``kiln serve`` binds its port before anything claims work,
and every process waits at most ``KILN_STARTUP_TIMEOUT_S`` for the database and the
storage to answer (SIGTERM and SIGINT end the wait); a port in use, an unreachable
backend or a missing extra is exit 2 with one line, a URL's password hidden. They stop
gracefully: the first SIGTERM or SIGINT drains (workers claim nothing more and let their
running attempts finish within ``KILN_SHUTDOWN_GRACE_S``, then give the rest back
uncounted; a supervisor hands its leadership over), a second one stops at once.
"""

from __future__ import annotations

# Each module registers its commands on ``cli``, in the order ``kiln --help`` lists them.
from kiln.cli import processes  # isort: split

from kiln.cli import tasks  # isort: split

from kiln.cli import bulk  # isort: split

from kiln.cli import schedules  # isort: split

from kiln.cli import operate
from kiln.cli.base import cli, main

__all__ = ["bulk", "cli", "main", "operate", "processes", "schedules", "tasks"]
