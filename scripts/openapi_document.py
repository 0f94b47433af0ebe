"""Print the OpenAPI document `kiln serve` answers at /openapi.json with its built-in kinds
(image.generate on the demo backend, image.transform, image.contact_sheet, comfy.workflow)
and no keys:
what clients/typescript/src/schema.d.ts is generated from (docs/typescript.md)."""

from __future__ import annotations

import json
import sys

from kiln.api import create_app
from kiln.app import App
from kiln.cli.base import with_builtin_kinds
from kiln.config import Settings


def document() -> dict[str, object]:
    app = with_builtin_kinds(App(settings=Settings()))
    served: dict[str, object] = create_app(app).openapi()
    return served


def main() -> int:
    json.dump(document(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
