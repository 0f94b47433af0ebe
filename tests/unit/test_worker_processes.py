"""How many `kiln worker` processes `kiln serve` starts beside itself
(KILN_WORKER_PROCESSES), and which kinds they serve."""

from __future__ import annotations

from pathlib import Path

import pytest

import kiln
from kiln.cli.worker_processes import kinds_without_gpu, process_count, worker_environment
from kiln.config import Settings
from kiln.errors import ConfigError


def test_auto_is_one_per_core_beyond_the_first_on_either_database() -> None:
    sqlite = Settings(database_url="sqlite:///k.db")
    postgres = Settings(database_url="postgresql://u@h/db")
    assert [process_count(sqlite, cores=n) for n in (1, 2, 8)] == [0, 1, 7]
    assert [process_count(postgres, cores=n) for n in (1, 2, 8)] == [0, 1, 7]


def test_a_count_is_taken_as_given_and_no_workers_starts_none() -> None:
    assert process_count(Settings(database_url="postgresql://u@h/db", worker_processes=3)) == 3
    assert process_count(Settings(worker_processes=0), cores=8) == 0
    assert process_count(Settings(worker_processes=2, no_workers=True), cores=8) == 0
    assert process_count(Settings(worker_processes=2, workers=0), cores=8) == 0


def test_the_setting_reads_auto_or_a_count_and_refuses_the_rest() -> None:
    assert Settings.from_env({"KILN_WORKER_PROCESSES": "auto"}).worker_processes is None
    assert Settings.from_env({"KILN_WORKER_PROCESSES": "3"}).worker_processes == 3
    for bad in ("-1", "1.5", "many"):
        with pytest.raises(ConfigError, match="KILN_WORKER_PROCESSES"):
            Settings.from_env({"KILN_WORKER_PROCESSES": bad})


def test_worker_processes_serve_the_kinds_that_take_no_gpu_slot(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, kind_resources={"c.pooled": {"gpu": 1}})
    app = kiln.App(settings=settings)

    @app.task("a.cpu")
    async def cpu(ctx: object, params: object) -> None: ...

    @app.task("b.gpu", resources={"gpu": 1})
    async def gpu(ctx: object, params: object) -> None: ...

    @app.task("c.pooled")
    async def pooled(ctx: object, params: object) -> None: ...

    kinds = kinds_without_gpu(app)
    assert kinds == ["a.cpu"]
    env = worker_environment(settings.with_(workers=5), kinds)
    assert (env["KILN_KINDS"], env["KILN_GPUS"], env["KILN_CONCURRENCY"]) == ("a.cpu", "0", "5")
    assert env["KILN_DATABASE_URL"] == settings.resolved_database_url
