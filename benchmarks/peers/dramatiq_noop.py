"""Dramatiq's drain rate on Redis, for benchmarks/peers.py (runs in the peers' own venv).

N no-op messages are sent, then one in-process worker (``--threads``) drains them: the
drain rate is N over the time from the worker's start until the last one ran; the
enqueue + drain rate counts the sending too. Dramatiq keeps no task status. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

parser = argparse.ArgumentParser()
parser.add_argument("--redis-url", required=True)
parser.add_argument("--tasks", type=int, default=3000)
parser.add_argument("--threads", type=int, default=8)
args = parser.parse_args()

broker = RedisBroker(url=args.redis_url)
broker.flush_all()
dramatiq.set_broker(broker)
done = threading.Semaphore(0)


@dramatiq.actor(max_retries=0, queue_name="bench")
def noop(n: int) -> None:
    done.release()


started = time.perf_counter()
for n in range(args.tasks):
    noop.send(n)
sent = time.perf_counter()
worker = dramatiq.Worker(broker, worker_threads=args.threads, worker_timeout=100)
worker.start()
for _ in range(args.tasks):
    done.acquire()
drained = time.perf_counter()
worker.stop()
print(json.dumps({
    "system": "dramatiq", "version": dramatiq.__version__, "tasks": args.tasks,
    "drain_per_s": round(args.tasks / (drained - sent), 1),
    "enqueue_drain_per_s": round(args.tasks / (drained - started), 1),
}))  # fmt: skip
