"""Targets (behind auth, like every /v1 route), health, readiness and metrics (open)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Response

from ...db import ping
from ...schemas import Health, TargetOut
from ..deps import ServicesDep
from ..metrics import CONTENT_TYPE
from .auth import PrincipalDep
from .problems import Problem

router = APIRouter()


@router.get(
    "/v1/targets",
    response_model=list[TargetOut],
    tags=["targets"],
    responses={401: {"description": "a problem"}},
)
def list_targets(principal: PrincipalDep) -> list[TargetOut]:
    """The edge targets a conversion can build for, and the rules their artifacts follow."""
    from quant.targets import PROFILES

    return [
        TargetOut(
            name=p.name,
            board=p.board,
            runtime=p.runtime,
            opset=p.opset,
            static_batch=p.static_batch,
            rules=list(p.rules),
            notes=p.notes,
        )
        for p in PROFILES.values()
    ]


@router.get("/healthz", response_model=Health, tags=["health"])
def healthz() -> Health:
    """The process answers."""
    return Health(status="ok")


@router.get(
    "/readyz", response_model=Health, tags=["health"], responses={503: {"description": "a problem"}}
)
def readyz(services: ServicesDep) -> Health:
    """The database answers, the data directory is writable and jobs are being dispatched
    (in Celery mode: the broker answers)."""
    try:
        ping(services.settings)
    except Exception as error:
        raise Problem(503, f"the database does not answer ({type(error).__name__})") from None
    if not os.access(services.settings.data_dir, os.W_OK):
        raise Problem(503, f"the data directory {services.settings.data_dir} is not writable")
    problem = services.queue.problem()
    if problem is not None:
        raise Problem(503, problem)
    return Health(status="ok")


@router.get(
    "/metrics",
    tags=["health"],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}}},
)
def metrics(services: ServicesDep) -> Response:
    """Prometheus metrics: jobs by state, queue depth, stage durations, upload bytes."""
    return Response(services.metrics.render(), media_type=CONTENT_TYPE)
