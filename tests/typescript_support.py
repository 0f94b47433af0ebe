"""The TypeScript client of clients/typescript for the tests: Node.js and npm found (a
loud skip outside CI, a failure in CI, where nothing is skipped for a missing component),
its pinned packages installed with `npm ci` when the lock file changed, and its tools run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "typescript"
SCHEMA = CLIENT / "src" / "schema.d.ts"
#: What `npm run generate` passes to openapi-typescript (package.json).
GENERATE_FLAGS = ("--default-non-nullable", "false")
MISSING_NODE = (
    "Node.js and npm are not installed: the TypeScript client's tests need Debian's "
    "`nodejs` and `npm` packages (`apt-get install -y nodejs npm`, or `make system-deps`)"
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require_node() -> None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        if in_ci():
            pytest.fail(MISSING_NODE)
        pytest.skip(MISSING_NODE)


def _installed() -> bool:
    """node_modules holds what package-lock.json pins (npm's own record of it)."""
    record = CLIENT / "node_modules" / ".package-lock.json"
    if not record.exists():
        return False
    wanted = json.loads((CLIENT / "package-lock.json").read_text())["packages"]
    have = json.loads(record.read_text())["packages"]
    return all(
        have.get(path, {}).get("version") == entry.get("version")
        for path, entry in wanted.items()
        if path
    )


def install() -> None:
    """`npm ci` in clients/typescript, unless node_modules already has the locked set."""
    require_node()
    if _installed():
        return
    done = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"


def tool(name: str, *args: str | Path, cwd: Path = CLIENT) -> subprocess.CompletedProcess[str]:
    """Run a tool of the client's node_modules (tsc, openapi-typescript, esbuild)."""
    binary = CLIENT / "node_modules" / ".bin" / name
    return subprocess.run(
        [str(binary), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
