"""Settings on the command line: every command refuses a bad value with one line and
exit 2; options take their help from the table; ``kiln settings`` prints the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln import config
from kiln.cli import cli

from .conftest import Processes, clean_env, free_port

runner = CliRunner()

BAD_TTL = {"KILN_LEASE_TTL_S": "abc"}
BAD_TTL_LINE = "kiln: KILN_LEASE_TTL_S='abc': expected a number of seconds > 0\n"
PROCESS_COMMANDS = [["serve", "--port", "0"], ["worker"], ["supervisor"], ["reconcile"]]


@pytest.mark.parametrize("args", [*PROCESS_COMMANDS, ["settings"]], ids=lambda args: args[0])
def test_every_command_refuses_a_bad_value_with_one_line(args: list[str]) -> None:
    # Given a lease TTL that is not a number, When a command starts
    result = runner.invoke(cli, args, env=BAD_TTL)

    # Then it exits 2 with one line naming the variable, the value and what it should be
    assert result.exit_code == 2
    assert result.stderr == BAD_TTL_LINE
    assert result.stdout == ""


def test_a_bad_value_under_an_old_name_is_named_as_set() -> None:
    result = runner.invoke(cli, ["worker"], env={"KILN_SUPERVISOR_INTERVAL": "0"})

    # (the deprecation line may come first, where logging is already set up)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "kiln: KILN_SUPERVISOR_INTERVAL='0': expected a number of seconds > 0"
    )


def test_a_bad_log_level_is_refused_before_logging_is_set_up() -> None:
    result = runner.invoke(cli, ["supervisor"], env={"KILN_LOG_LEVEL": "chatty"})

    assert result.exit_code == 2
    assert result.stderr.startswith("kiln: KILN_LOG_LEVEL='chatty': expected DEBUG, INFO")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("command", "env"),
    [
        ("serve", {"KILN_PORT": "eighty"}),
        ("serve", {"KILN_PORT": "+0"}),
        ("worker", {"KILN_CONCURRENCY": "0"}),
    ],
)
def test_a_real_process_with_a_bad_value_exits_2_printing_one_line(
    processes: Processes, command: str, env: dict[str, str]
) -> None:
    # Given a real `kiln serve` / `kiln worker` process with a bad value
    process = processes.start(command, [command], clean_env(**env))

    # When it ends / Then it exited 2, having printed exactly one line (no traceback)
    assert process.popen.wait(timeout=60) == 2
    [name] = env
    [line] = process.output().splitlines()
    assert line.startswith(f"kiln: {name}={env[name]!r}: expected ")


def test_an_old_name_works_and_says_so_once(tmp_path: Path) -> None:
    # Given the lease TTL under its old name, When `kiln settings` runs in a real process
    done = subprocess.run(
        [sys.executable, "-m", "kiln", "settings"],
        env=clean_env(KILN_LEASE_TTL="5", COLUMNS="200"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )

    # Then the value is read, and one line on stderr names the new name
    assert done.returncode == 0
    assert done.stderr == "KILN_LEASE_TTL is deprecated: set KILN_LEASE_TTL_S instead\n"
    [row] = [line for line in done.stdout.splitlines() if "KILN_LEASE_TTL_S" in line]
    assert row.split("│")[2].strip() == "5"


def test_an_option_takes_its_help_variable_and_default_from_the_table() -> None:
    result = runner.invoke(cli, ["worker", "--help"], terminal_width=200)

    assert result.exit_code == 0
    var = config.variable("concurrency")
    assert f"[env {var.name}; default 2]" in result.stdout
    assert "--interval-s" in runner.invoke(cli, ["supervisor", "--help"]).stdout


def test_an_option_wins_over_its_variable() -> None:
    # Given KILN_KINDS naming a kind that exists, and --kinds one that does not
    result = runner.invoke(
        cli, ["worker", "--kinds", "video.nope"], env={"KILN_KINDS": "image.generate"}
    )

    # Then the option is what the worker goes by
    assert result.exit_code == 2
    assert result.stderr == "kiln: no task kind video.nope is registered\n"


def test_a_variable_stands_in_for_its_option() -> None:
    result = runner.invoke(cli, ["worker"], env={"KILN_KINDS": "image.generate, video.nope"})

    assert result.exit_code == 2
    assert result.stderr == "kiln: no task kind video.nope is registered\n"


def test_settings_prints_every_variable_and_hides_secrets() -> None:
    result = runner.invoke(
        cli,
        ["settings"],
        env={"KILN_ADMIN_KEY": "adm1n-secret", "KILN_PORT": str(free_port()), "COLUMNS": "250"},
    )

    assert result.exit_code == 0
    for var in config.VARIABLES:
        assert var.name in result.stdout
    assert "adm1n-secret" not in result.stdout
    assert "(set)" in result.stdout


def test_settings_markdown_is_the_documented_table() -> None:
    result = runner.invoke(cli, ["settings", "--markdown"])

    assert result.exit_code == 0
    assert result.stdout == config.markdown()


@pytest.mark.parametrize(("command", "flag"), [("serve", "--port"), ("worker", "--metrics-port")])
def test_a_signed_port_option_exits_2_printing_one_line(
    processes: Processes, command: str, flag: str
) -> None:
    # Given a real process asked for a port written with a sign (`int()` would take it)
    process = processes.start(command, [command, flag, "+0"], clean_env())

    # Then it exits 2 with one line naming the option, as a variable would be named
    assert process.popen.wait(timeout=60) == 2
    [line] = process.output().splitlines()
    assert line == f"kiln: {flag}='+0': expected a port number >= 0 and <= 65535"
