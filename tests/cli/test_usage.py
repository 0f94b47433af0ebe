"""Usage, configuration and connection errors: exit 2 with one line on stderr, no traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.cli import cli

from .conftest import free_port

runner = CliRunner()


def test_unknown_option_is_a_usage_error() -> None:
    result = runner.invoke(cli, ["submit", "a fox", "--bogus"])

    assert result.exit_code == 2
    assert "--bogus" in result.stderr


def test_unknown_command_is_a_usage_error() -> None:
    result = runner.invoke(cli, ["bake"])

    assert result.exit_code == 2
    assert "bake" in result.stderr


def test_missing_prompt_is_a_usage_error() -> None:
    result = runner.invoke(cli, ["submit"])

    assert result.exit_code == 2


def test_out_of_range_option_is_a_usage_error() -> None:
    result = runner.invoke(cli, ["list", "--limit", "0"])

    assert result.exit_code == 2


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7", "::"])
def test_serve_refuses_a_public_address_without_api_keys(host: str) -> None:
    result = runner.invoke(cli, ["serve", "--host", host, "--port", str(free_port())])

    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert "refusing to listen" in result.stderr
    assert "--insecure" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("no-colon-here", "is not tenant:key"),
        ("admin:secret", "reserved tenant"),
        ("acme:k1,acme2:k1", "same key twice"),
    ],
)
def test_serve_refuses_bad_api_keys(keys: str, message: str) -> None:
    result = runner.invoke(cli, ["serve", "--port", str(free_port())], env={"KILN_API_KEYS": keys})

    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_serve_refuses_an_admin_key_equal_to_a_tenant_key() -> None:
    result = runner.invoke(
        cli,
        ["serve", "--port", str(free_port())],
        env={"KILN_API_KEYS": "acme:same", "KILN_ADMIN_KEY": "same"},
    )

    assert result.exit_code == 2
    assert "KILN_ADMIN_KEY" in result.stderr


def test_bad_numeric_setting_is_a_usage_error() -> None:
    result = runner.invoke(cli, ["reconcile"], env={"KILN_LEASE_TTL": "soon"})

    assert result.exit_code == 2
    assert "KILN_LEASE_TTL" in result.stderr


def test_unsupported_database_url_is_a_usage_error() -> None:
    result = runner.invoke(cli, ["reconcile", "--database-url", "mysql://db/kiln"])

    assert result.exit_code == 2
    assert "mysql://db/kiln" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["status", "tsk_x"],
        ["submit", "a red fox"],
        ["watch", "tsk_x"],
        ["cancel", "tsk_x"],
        ["retry", "tsk_x"],
        ["list"],
    ],
)
def test_unreachable_server_exits_2_with_one_line(args: list[str]) -> None:
    server = f"http://127.0.0.1:{free_port()}"

    result = runner.invoke(cli, [*args, "--server", server])

    assert result.exit_code == 2
    assert result.stderr == f"kiln: cannot reach {server}: connection refused\n"
    assert result.stdout == ""


def test_server_option_reads_its_environment_variable() -> None:
    server = f"http://127.0.0.1:{free_port()}"

    result = runner.invoke(cli, ["status", "tsk_x"], env={"KILN_SERVER": server})

    assert result.exit_code == 2
    assert server in result.stderr


def test_simulate_must_be_a_json_object() -> None:
    result = runner.invoke(cli, ["submit", "a fox", "--simulate", "[1, 2]"])

    assert result.exit_code == 2
    assert "--simulate" in result.stderr


def test_states_prints_the_diagram_from_the_table() -> None:
    from kiln.states import TRANSITIONS

    result = runner.invoke(cli, ["states"])

    assert result.exit_code == 0
    assert result.stdout.startswith("stateDiagram-v2\n")
    for rule in TRANSITIONS:
        assert f": {rule.event}\n" in result.stdout


def test_worker_refuses_an_unknown_kind() -> None:
    result = runner.invoke(cli, ["worker", "--kinds", "image.generate,video.nope"])

    assert result.exit_code == 2
    assert result.stderr == "kiln: no task kind video.nope is registered\n"
