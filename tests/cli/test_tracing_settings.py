"""KILN_TRACING and the OTEL_* variables a process cannot use: one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli import cli

runner = CliRunner()


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"KILN_TRACING": "sometimes"},
         "kiln: KILN_TRACING='sometimes': expected auto, on or off"),
        ({"KILN_TRACING": "on", "OTEL_TRACES_EXPORTER": "zipkin"},
         "kiln: OTEL_TRACES_EXPORTER='zipkin': expected otlp, console or none"),
        ({"OTEL_TRACES_EXPORTER": "jaeger"},
         "kiln: OTEL_TRACES_EXPORTER='jaeger': expected otlp, console or none"),
    ],
)  # fmt: skip
def test_a_worker_refuses_a_tracing_setting_it_cannot_use(
    tmp_path: Path, env: dict[str, str], line: str
) -> None:
    result = runner.invoke(cli, ["worker"], env={"KILN_DATA_DIR": str(tmp_path), **env})

    assert result.exit_code == 2
    assert result.stderr.splitlines() == [line]
    assert result.stdout == ""
