"""Prometheus metrics: jobs by state, queue depth, stage durations, upload bytes.

Job counts and stage durations are read from the database at each scrape (the database is the
truth, and it survives restarts); upload bytes are counted as they arrive in this process.
Each app has its own registry, so several apps in one process (tests) never collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from sqlalchemy import func, select

from .. import jobs
from ..db import JobStage, session_scope
from ..settings import Settings

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _DatabaseCollector:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        with session_scope(self.settings) as session:
            counts = jobs.counts_by_state(session)
            stages = session.execute(
                select(JobStage.stage, func.count(), func.sum(JobStage.seconds))
                .group_by(JobStage.stage)
                .order_by(JobStage.stage)
            ).all()
        by_state = GaugeMetricFamily("edge_un_jobs", "Conversion jobs by state", labels=["state"])
        for state, count in counts.items():
            by_state.add_metric([state], count)
        yield by_state
        yield GaugeMetricFamily(
            "edge_un_queue_depth", "Jobs waiting for a worker", value=counts["queued"]
        )
        yield GaugeMetricFamily(
            "edge_un_workers",
            "Conversion processes that may run at once",
            value=self.settings.workers,
        )
        durations = SummaryMetricFamily(
            "edge_un_stage_duration_seconds",
            "Time conversion jobs spent in each pipeline stage",
            labels=["stage"],
        )
        for stage, count, total in stages:
            durations.add_metric([stage], count_value=count, sum_value=total or 0.0)
        yield durations


class Metrics:
    def __init__(self, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        self.upload_bytes = Counter(
            "edge_un_upload_bytes",
            "Bytes of uploaded files received (accepted or not)",
            ["field"],
            registry=self.registry,
        )
        self.uploads = Counter(
            "edge_un_uploads",
            "Conversion requests by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(_DatabaseCollector(settings))

    def render(self) -> bytes:
        return generate_latest(self.registry)
