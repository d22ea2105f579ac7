"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edge_un import data
from service.local_stack import QUEUE_MODES, ServiceMode

from .builders import trained_small_model
from .servers import postgres_server, redis_server  # noqa: F401  (session fixtures)


@pytest.fixture
def small_vit() -> nn.Module:
    return trained_small_model("vit", "un")


@pytest.fixture(scope="module")
def one_thread():
    """Training tests: two threads on two cores shared with other processes oversubscribe and
    crawl (use with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits() -> data.Dataset:
    return data.load_dataset("digits")


@pytest.fixture(scope="module", params=QUEUE_MODES)
def service_mode(request: pytest.FixtureRequest) -> ServiceMode:
    """Every service test that starts a server runs in both queue modes: ``local`` (SQLite,
    the server's own job processes) and ``celery`` (PostgreSQL, Redis, Celery workers)."""
    if request.param == "celery":
        postgres = request.getfixturevalue("postgres_server")
        redis = request.getfixturevalue("redis_server")
        return ServiceMode("celery", postgres, redis)
    return ServiceMode("local")
