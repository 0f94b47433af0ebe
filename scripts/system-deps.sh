#!/usr/bin/env bash
# System packages the test suite drives for real: Chromium for the dashboard's browser tests,
# PostgreSQL's server binaries (initdb, pg_ctl, pgbench) for the PostgreSQL store's tests,
# Node.js and npm for the TypeScript client (clients/typescript: generate, tsc, esbuild).
# Quick when already installed; installs with apt-get (as root) when missing.
set -euo pipefail

need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "kiln: missing system packages: ${need[*]} (run as root, or: sudo apt-get install -y ${need[*]})" >&2
  exit 1
fi
echo "kiln: installing ${need[*]} ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
