"""A separate OS process using the store, for the multi-process conformance tests.

    python store_client.py URL submit COUNT BODY KEY   (KEY "-" for none; dedup off with a key)
    python store_client.py URL claim

It prints ``ready``, waits for one line on stdin so that every process starts together,
then prints one JSON line: the submissions' outcomes, or the ids it claimed.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

from factories import KIND, make_new_task  # type: ignore[import-not-found]

from kiln.errors import KilnError
from kiln.store import Store, open_store


async def submit(store: Store, count: int, body: str, key: str | None) -> list[dict[str, Any]]:
    async def one() -> dict[str, Any]:
        new = make_new_task({"prompt": body}, idempotency_key=key, dedup=key is None)
        try:
            result = await store.submit(new)
        except KilnError as exc:
            return {"error": exc.code}
        return {"id": result.task.id, "created": result.created}

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def claim(store: Store) -> list[str]:
    claimed: list[str] = []
    rng = random.Random()
    while True:
        tasks = await store.claim(
            worker_id=f"p{id(store)}", kinds=[KIND], limit=rng.randint(1, 5), lease_ttl_s=60
        )
        if not tasks:
            return claimed
        claimed += [t.id for t in tasks]


async def main(argv: list[str]) -> Any:
    url, mode = argv[0], argv[1]
    store = open_store(url, clock=time.time)
    try:
        print("ready", flush=True)
        sys.stdin.readline()
        if mode == "submit":
            key = None if argv[4] == "-" else argv[4]
            return await submit(store, int(argv[2]), argv[3], key)
        return await claim(store)
    finally:
        await store.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))), flush=True)
