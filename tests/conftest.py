"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from edge_un import data
from testbed.live import QUEUE_MODES, LiveServer, ServiceMode, fast_job_files

from .builders import example_vit_onnx, trained_small_model
from .databases import postgres_settings, settings  # noqa: F401  (database fixtures)
from .servers import missing, postgres_server, redis_server  # noqa: F401  (session fixtures)

# pytest-xdist runs two test processes on the two cores: one torch thread each, or their
# thread pools oversubscribe the cores and every tensor op waits (the job processes that the
# service tests start choose their own threads, EDGE_UN_JOB_THREADS)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def small_vit() -> nn.Module:
    return trained_small_model("vit", "un")


@pytest.fixture(scope="session")
def _example_vit(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Folded, exported and sampled once per session: several modules read it."""
    return example_vit_onnx(tmp_path_factory.mktemp("vit_onnx"))


@pytest.fixture(scope="module")
def vit_onnx(_example_vit: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The bundled trained UN ViT folded: ``fp32[target]`` its fp32 ONNX file for a target
    (exported on first use, shared by the session's modules), ``calibration`` and
    ``evaluation`` samples of its own data, and ``dir`` a directory for the module's own files
    (tests/builders.py, ``example_vit_onnx``)."""
    return {**_example_vit, "dir": tmp_path_factory.mktemp("vit_module")}


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
    the server's own job processes) and ``celery`` (PostgreSQL, Redis, Celery workers).
    A module whose server runs in one mode only overrides this fixture with that mode."""
    if request.param == "celery":
        postgres = request.getfixturevalue("postgres_server")
        redis = request.getfixturevalue("redis_server")
        return ServiceMode("celery", postgres, redis)
    return ServiceMode("local")


@pytest.fixture(scope="module")
def celery_mode(postgres_server, redis_server) -> ServiceMode:  # noqa: F811 (session fixtures)
    """Celery mode alone: PostgreSQL, Redis, ``edge-un worker`` processes."""
    return ServiceMode("celery", postgres_server, redis_server)


def two_workers(mode: ServiceMode, data_dir: Path) -> Iterator[LiveServer]:
    fast_job_files()  # build the inputs before any clock starts
    server = mode.server(data_dir, EDGE_UN_WORKERS="2").start()
    yield server
    server.stop()


@pytest.fixture
def cluster(tmp_path: Path, celery_mode: ServiceMode) -> Iterator[LiveServer]:
    """A Celery-mode API and two workers, stopped after the test (one that kills a worker)."""
    yield from two_workers(celery_mode, tmp_path / "data")


@pytest.fixture(scope="module")
def shared_cluster(
    tmp_path_factory: pytest.TempPathFactory, celery_mode: ServiceMode
) -> Iterator[LiveServer]:
    """A Celery-mode API and two workers for a module's tests that leave them as they found
    them (every job ended, both workers alive)."""
    yield from two_workers(celery_mode, tmp_path_factory.mktemp("cluster") / "data")


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    service_mode: ServiceMode,
) -> Iterator[LiveServer]:
    """The module's live server (testbed.live), in ``service_mode``, stopped after
    the module. Its EDGE_UN_* settings beyond testbed.live.FAST are the module's
    ``SERVER_ENV`` (a dict; none if the module has none)."""
    env = getattr(request.module, "SERVER_ENV", {})
    name = request.module.__name__.rsplit(".", 1)[-1]
    live = service_mode.server(tmp_path_factory.mktemp(name) / "data", **env)
    try:
        yield live.start()
    finally:
        live.stop()


@pytest.fixture(scope="module")
def token(server: LiveServer) -> str:
    """A token of the module's server."""
    return server.token()


@pytest.fixture(scope="module")
def client(server: LiveServer, token: str) -> Iterator[httpx.Client]:
    """An HTTP client of the module's server, signed in with ``token``."""
    with server.client(token) as client:
        yield client


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where ``browser`` saves what it downloads."""
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest, downloads: Path) -> Iterator[object]:
    """The system's Chromium, headless, through the system chromedriver (given by its path:
    Selenium Manager, which downloads drivers, never runs). Its console log is kept, downloads
    go to ``downloads`` unasked, nothing of Chrome's own goes out; its window is the module's
    ``BROWSER_WINDOW`` (default a laptop's screen). Under CI=true a missing Chromium fails the
    test, never skips it."""
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if absent:
        missing(f"{', '.join(absent)} missing: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    window = getattr(request.module, "BROWSER_WINDOW", "1366,768")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={window}", "--no-first-run", "--disable-extensions",
                     "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--disable-default-apps"):  # fmt: skip
        options.add_argument(argument)
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(downloads), "download.prompt_for_download": False},
    )
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.execute_cdp_cmd(
            "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
        )
        driver.set_page_load_timeout(60)
        yield driver
    finally:
        driver.quit()
