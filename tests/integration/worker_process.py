"""A kiln worker process for crash tests: the demo kind on a given database and storage.

``--kill-before-put SUFFIX`` / ``--kill-after-put SUFFIX`` make the process SIGKILL itself
when it writes an object whose key ends with SUFFIX, just before or just after the write:
a real crash at a precise instruction (mid-upload, or after the manifest but before the
task's SUCCESS is committed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from urllib.parse import urlparse

import kiln
from kiln import demo
from kiln.limits import parse_pools
from kiln.storage import StorageWrapper
from kiln.storage.local import LocalStorage


class CrashingStorage(StorageWrapper):
    """LocalStorage that kills its own process around the write of one chosen key."""

    def __init__(self, inner: LocalStorage, *, before: str | None, after: str | None) -> None:
        super().__init__(inner)
        self.before = before
        self.after = after

    async def put(self, key: str, data: bytes) -> None:
        if self.before and key.endswith(self.before):
            os.kill(os.getpid(), signal.SIGKILL)
        await self.inner.put(key, data)
        if self.after and key.endswith(self.after):
            os.kill(os.getpid(), signal.SIGKILL)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--database", required=True)
    parser.add_argument("--storage", required=True, help="file:///absolute/path")
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--gpu", type=int, default=1, help="gpu pool capacity")
    parser.add_argument(
        "--pools", default=None, metavar="NAME:N,...",
        help="shared pools (KILN_POOLS); image.generate takes one slot of each",
    )  # fmt: skip
    parser.add_argument("--kill-before-put", default=None, metavar="SUFFIX")
    parser.add_argument("--kill-after-put", default=None, metavar="SUFFIX")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    pools = parse_pools(args.pools)
    settings = kiln.Settings(
        database_url=args.database,
        storage_url=args.storage,
        lease_ttl_s=args.lease_ttl,
        pools=pools,
        kind_resources={"image.generate": dict.fromkeys(pools, 1)},
    )
    storage = None
    if args.kill_before_put or args.kill_after_put:
        local = LocalStorage(Path(urlparse(args.storage).path))
        storage = CrashingStorage(local, before=args.kill_before_put, after=args.kill_after_put)
    app = kiln.App(settings=settings, storage_backend=storage)
    demo.register(app)
    async with app:
        worker = app.worker(
            concurrency=args.concurrency,
            resources={"gpu": args.gpu},
            lease_ttl_s=args.lease_ttl,
            idle_poll_s=(0.02, 0.1),
        )
        logging.getLogger("kiln").info("worker_started", extra={"worker_id": worker.worker_id})
        await worker.run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main(parse_args()))
