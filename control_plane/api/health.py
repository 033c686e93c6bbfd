"""Liveness: answers only when the database does, and says that a control plane answered (which one:
its instance id), so that clients can tell it from a router or from another control plane."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from control_plane.auth import Ctx
from control_plane.errors import ServiceUnavailable
from meridian.admin_api import ControlPlaneHealth

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/health")
def health(ctx: Ctx) -> ControlPlaneHealth:
    try:
        with ctx.read() as session:
            session.execute(text("SELECT 1"))
    except SQLAlchemyError as e:
        log.warning("health check: database unreachable: %s", e)
        raise ServiceUnavailable("database unreachable") from e
    return ControlPlaneHealth(instance_id=ctx.settings.instance_id)
