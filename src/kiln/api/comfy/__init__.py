"""The Comfy API v2 face (docs/comfy.md): ``/api/v2/`` jobs, assets and health, served by
``kiln serve`` beside ``/v1``. A job is a kiln task of kind ``comfy.workflow``."""

from __future__ import annotations

from fastapi import APIRouter

from kiln.api.comfy import assets, jobs, openapi, streams
from kiln.api.comfy.errors import install as install_errors

router = APIRouter()
router.include_router(jobs.router)  # streams.py adds the events route to it
router.include_router(assets.router)
router.include_router(openapi.router)  # GET /api/v2/openapi.json

__all__ = ["install_errors", "router", "streams"]
