"""`kiln worker` processes (the real command, built-in kinds on KILN_BACKEND) for tests
that need workers of their own: started with a given environment, stopped with SIGTERM
or killed with SIGKILL, their JSON logs read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import kiln
from kiln import backends
from kiln.config import Settings


class CliWorkers:
    """`kiln worker` processes on one database and storage, each with its own log."""

    def __init__(self, root: Path, database_url: str, **env: str) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.database_url = database_url
        self.storage_url = (root / "results").as_uri()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        self.env.update({"KILN_DATABASE_URL": database_url, "KILN_STORAGE_URL": self.storage_url,
                         "KILN_LEASE_TTL_S": "3", "KILN_LOG_FORMAT": "json", **env})  # fmt: skip
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        log = self.root / f"worker-{len(self.procs)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", "worker", *args],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
            )  # fmt: skip
        self.procs.append((proc, log))
        return proc

    def start_supervisor(self) -> subprocess.Popen[bytes]:
        log = self.root / f"supervisor-{len(self.procs)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", "supervisor"],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
            )  # fmt: skip
        self.procs.append((proc, log))
        return proc

    def app(self, **settings: Any) -> kiln.App:
        """An App on the same database and storage, with the built-in kinds (as `kiln
        serve` registers them), to submit and read with."""
        app = kiln.App(settings=Settings(data_dir=self.root, database_url=self.database_url,
                                         storage_url=self.storage_url, **settings))  # fmt: skip
        backends.register(app)
        return app

    def lines(self, event: str) -> list[dict[str, Any]]:
        """Every worker's JSON log lines of ``event``."""
        found = []
        for _, log in self.procs:
            for line in log.read_text(errors="replace").splitlines():
                if f'"{event}"' in line and line.startswith("{"):
                    record = json.loads(line)
                    if record.get("event") == event:
                        found.append(record)
        return found

    def count(self, event: str) -> list[int]:
        """How many ``event`` lines each worker logged."""
        return [log.read_text(errors="replace").count(f'"{event}"') for _, log in self.procs]

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def tail(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                         for _, log in self.procs)  # fmt: skip
