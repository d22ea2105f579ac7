"""What the service's operations work with: built once per API process (``create_app``) and
handed to the routes, the web page and the domain functions they call."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings
from ..storage import ArtifactStore
from ..worker.queue import JobQueue
from .metrics import Metrics


@dataclass(frozen=True)
class Services:
    settings: Settings
    store: ArtifactStore
    queue: JobQueue
    metrics: Metrics
