#!/usr/bin/env bash
# `make run`: kiln serve on SQLite and ./kiln-data, then a first task to watch on the dashboard.
set -euo pipefail
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
KILN=.venv/bin/kiln
URL="http://$HOST:$PORT"

"$KILN" serve --host "$HOST" --port "$PORT" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null' INT TERM EXIT

for _ in $(seq 1 150); do
  if .venv/bin/python -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=1)" "$URL/healthz" 2>/dev/null; then
    break
  fi
  kill -0 "$server" 2>/dev/null || { echo "kiln serve exited" >&2; exit 1; }
  sleep 0.2
done

echo
echo "  Dashboard: $URL/   (Ctrl-C stops kiln)"
echo
"$KILN" submit "a lighthouse on a cliff at dusk, stormy sea" --steps 50 --step-ms 150 --server "$URL" --wait || true
wait "$server"
