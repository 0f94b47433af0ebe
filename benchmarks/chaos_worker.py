"""The chaos run's worker process: `kiln worker`, with a storage that fails some writes.

It is built from the same pieces as `kiln worker` (``Settings.from_env()``, the engine's
logs, the built-in kinds, ``app.worker``), reads the same ``KILN_*`` variables, and only
wraps the storage: each ``put`` goes wrong with probability ``--fault-rate``, in one of
three ways a real object store can:

- ``refused``: a StorageError, nothing written (a full disk, a refused connection);
- ``torn``: the object is written, then a StorageError (the caller cannot tell it landed);
- ``corrupt``: the object is written with its first byte flipped and the put returns.

Each injected fault is appended as one line to ``<fault-log>/<pid>.log`` before it takes
effect, so the count survives the SIGKILLs of the run.

    KILN_DATABASE_URL=... KILN_STORAGE_URL=... python benchmarks/chaos_worker.py --fault-rate 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
from pathlib import Path

import kiln
from kiln import backends, logs, transform
from kiln.config import Settings
from kiln.errors import StorageError
from kiln.storage import Storage, StorageWrapper, open_storage

FAULTS = ("refused", "torn", "corrupt")


class FaultyStorage(StorageWrapper):
    """A Storage whose writes fail at ``rate``; every fault is logged to ``log_path``."""

    def __init__(self, inner: Storage, *, rate: float, rng: random.Random, log_path: Path) -> None:
        super().__init__(inner)
        self.rate = rate
        self.rng = rng
        self.log_path = log_path
        self.injected = 0

    async def put(self, key: str, data: bytes) -> None:
        if self.rng.random() >= self.rate:
            await self.inner.put(key, data)
            return
        fault = self.rng.choice(FAULTS)
        self._record(fault, key)
        if fault == "refused":
            raise StorageError(f"injected fault: write of {key} refused")
        if fault == "torn":
            await self.inner.put(key, data)
            raise StorageError(f"injected fault: write of {key} reported failed")
        flipped = bytes([data[0] ^ 0xFF]) + data[1:] if data else b"\x00"
        await self.inner.put(key, flipped)

    def _record(self, fault: str, key: str) -> None:
        self.injected += 1
        line = f"{fault} {key}\n".encode()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def build_app(settings: Settings, storage: Storage, *, no_slot: bool = False) -> kiln.App:
    """The app `kiln worker` builds (the built-in kinds), on the given storage; with
    ``no_slot`` image.generate takes no GPU slot (a claim acquires its tasks at once)."""
    app = kiln.App(settings=settings, storage_backend=storage)
    backends.register(app, resources={} if no_slot else None)
    transform.register(app)
    return app


async def run(app: kiln.App, concurrency: int, gpus: int) -> None:
    """Run a worker until SIGTERM or SIGINT, as `kiln worker` does."""
    async with app:
        worker = app.worker(concurrency=concurrency, resources={"gpu": gpus})
        running = asyncio.ensure_future(worker.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, running.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await running


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault-rate", type=float, default=0.05, help="share of puts that fail")
    parser.add_argument("--fault-log", type=Path, required=True, help="folder of fault logs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault dice")
    parser.add_argument("--concurrency", type=int, default=4, help="tasks run at once")
    parser.add_argument("--gpus", type=int, default=2, help="gpu slots")
    parser.add_argument("--no-slot", action="store_true", help="image.generate takes no slot")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = Settings.from_env()
    logs.setup(fmt=settings.log_format, level=settings.log_level)
    args.fault_log.mkdir(parents=True, exist_ok=True)
    storage = FaultyStorage(
        open_storage(settings.resolved_storage_url),
        rate=args.fault_rate,
        rng=random.Random(args.seed),
        log_path=args.fault_log / f"{os.getpid()}.log",
    )
    app = build_app(settings, storage, no_slot=args.no_slot)
    asyncio.run(run(app, args.concurrency, args.gpus))


if __name__ == "__main__":
    main()
