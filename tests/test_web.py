"""The web page for people (/ui) in the system's Chromium, against a real server.

Signed in with a token, a person uploads the bundled UN ViT, watches the job finish on the page
that refreshes itself, opens the report, and downloads an artifact whose sha256 is the one the
report lists; with another token the same browser sees none of it. Around that, over plain HTTP:
the Content-Security-Policy of report.html on every page, and forms refused without their CSRF
token or from another origin. Under CI=true a missing Chromium fails the test, never skips it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edge_un import examples
from service.report_html import CSP

from .servers import missing
from .service_live import LiveServer

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MODEL = examples.path("vit-mnist-un")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("web") / "data", EDGE_UN_WORKERS="1").start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def browser(downloads: Path) -> Iterator[object]:
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if absent:
        missing(f"{', '.join(absent)} missing: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # as tests/test_report_html.py; a laptop's screen; nothing of Chrome's own goes out
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1366,768", "--no-first-run", "--disable-extensions",
                     "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--disable-default-apps"):  # fmt: skip
        options.add_argument(argument)
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(downloads), "download.prompt_for_download": False},
    )
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver's path given: Selenium Manager (which downloads drivers) never runs
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
    )
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def text(browser, selector: str) -> str | None:
    """An element's text, read in one script call (the page may reload itself meanwhile)."""
    return browser.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
        selector,
    )


def severe(browser) -> list[dict]:
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"not {what} after {timeout} s")


def click_to(browser, by: str, value: str, heading: str | None = None) -> None:
    """Click what leads to another page; return once it is there (a form's answer comes after
    the click returns)."""
    before = browser.execute_script("return window.performance.timeOrigin")
    browser.find_element(by, value).click()

    def arrived() -> bool:
        now = browser.execute_script("return window.performance.timeOrigin")
        ready = browser.execute_script("return document.readyState") == "complete"
        return now != before and ready and (heading is None or text(browser, "h1") == heading)

    wait_until(arrived, 60, f"on the page after clicking {value!r}")


def sign_in(browser, server: LiveServer, token: str) -> None:
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(f"{server.url}/ui/")
    assert browser.current_url == f"{server.url}/ui/signin"  # not signed in: sent to sign in
    browser.find_element(By.ID, "token").send_keys(token)
    click_to(browser, By.ID, "signin", "Conversions")
    assert browser.current_url == f"{server.url}/ui/"


def test_a_person_converts_in_the_browser(browser, server, downloads) -> None:
    from selenium.webdriver.common.by import By

    alice, bob = server.token("alice"), server.token("bob")
    sign_in(browser, server, alice)
    assert "No conversions yet" in text(browser, "#jobs-table")

    # upload the bundled example for the cpu target
    click_to(browser, By.LINK_TEXT, "New conversion", "New conversion")
    browser.find_element(By.ID, "model").send_keys(str(MODEL))
    browser.find_element(By.CSS_SELECTOR, 'input[name="targets"][value="cpu"]').click()
    click_to(browser, By.ID, "upload", MODEL.name)
    job_url = browser.current_url
    assert job_url.startswith(f"{server.url}/ui/jobs/"), text(browser, "main")
    job_id = job_url.rsplit("/", 1)[1]

    # the job's page follows it by itself (it reloads while the job is queued or running) ...
    states: list[str] = []

    def seen(selector: str) -> str:
        state = (text(browser, selector) or "").split(" ")[0]
        if state and (not states or states[-1] != state):
            states.append(state)
        return state

    wait_until(lambda: seen("#job-state") != "queued", 120, "started")
    # ... and so does the list, which the test only opens: each reload is a new document
    click_to(browser, By.LINK_TEXT, "Conversions", "Conversions")
    loaded = browser.execute_script("return window.performance.timeOrigin")
    finished = ("succeeded", "failed", "cancelled")
    wait_until(lambda: seen(f"#job-{job_id} .state") in finished, 300, "finished on the list")
    assert states[-1] == "succeeded", text(browser, "main")
    assert "running" in states, states  # watched while it ran, not only once it was done
    assert browser.execute_script("return window.performance.timeOrigin") != loaded
    assert text(browser, f"#job-{job_id} .progress") == "100 %"
    # no horizontal scroll bar on a laptop's screen
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    )
    assert severe(browser) == []
    browser.get(job_url)
    assert text(browser, "#job-state").startswith("succeeded · 100 %"), text(browser, "main")

    # the report: the same page as the API's, loading nothing, naming the model's modules
    browser.get(job_url)
    click_to(browser, By.ID, "report-link")
    assert browser.title == "edge-un conversion: vit-mnist-un"
    assert text(browser, "#drift-table tbody tr td") == "cpu"
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    modules = browser.execute_script(
        "return [...document.querySelectorAll('#cpu-worst-table tbody tr')]"
        ".map(r => r.cells[0].textContent);"
    )
    assert modules and all(m.startswith("blocks.") for m in modules), modules
    assert severe(browser) == []

    # download the int8 file: its sha256 is the one the report lists
    browser.get(job_url)
    browser.find_element(By.LINK_TEXT, "cpu/model_int8.onnx").click()
    saved = downloads / "model_int8.onnx"
    wait_until(saved.is_file, 60, "downloaded")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {alice}"}) as api:
        report = api.get(f"/v1/conversions/{job_id}/report").json()
    listed = next(a for a in report["targets"]["cpu"]["artifacts"] if a["name"].endswith(".onnx")
                  and a["name"].startswith("cpu/"))  # fmt: skip
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == listed["sha256"]

    # another token sees none of it: not in the list, not the page, not the report or files
    click_to(browser, By.CSS_SELECTOR, "header button", "Sign in")  # sign out
    assert browser.current_url == f"{server.url}/ui/signin"
    sign_in(browser, server, bob)
    assert "No conversions yet" in text(browser, "#jobs-table")
    for path in ("", "/report", "/artifacts/cpu/model_int8.onnx", "/bundle.zip"):
        browser.get(f"{job_url}{path}")
        assert text(browser, "h1") == "Not found", (path, text(browser, "main"))
        assert job_id not in (text(browser, "main") or "").replace(f"'{job_id}'", "")


def test_every_page_has_the_report_policy_and_forms_need_their_token(server) -> None:
    token = server.token("carol")
    with httpx.Client(base_url=server.url) as web:
        page = web.get("/ui/signin")
        csrf = web.cookies["edge_un_csrf"]
        assert 'name="csrf" value="' + csrf + '"' in page.text
        # a sign-in without the form's token, or posted from another site, is refused
        elsewhere = {"Origin": "http://evil.test"}
        for data, headers in (({"token": token}, {}), ({"token": token, "csrf": csrf}, elsewhere)):
            refused = web.post("/ui/signin", data=data, headers=headers)
            assert refused.status_code == 403 and "edge_un_session" not in web.cookies
        wrong = web.post("/ui/signin", data={"token": "eun_nope", "csrf": csrf})
        assert wrong.status_code == 401 and "unknown or revoked" in wrong.text
        signed = web.post("/ui/signin", data={"token": token, "csrf": csrf},
                          headers={"Origin": server.url})  # fmt: skip
        assert signed.status_code == 303 and "edge_un_session" in web.cookies
        cookie = next(c for c in signed.headers.get_list("set-cookie") if "edge_un_session" in c)
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        for path in ("/ui/signin", "/ui/", "/ui/new", "/ui/jobs/nope", "/ui/jobs/nope/report"):
            response = web.get(path)
            assert response.headers["content-security-policy"] == CSP, path
            assert "<script" not in response.text and "http://" not in response.text, path
        # an upload without the form's token is refused before its body is read
        with MODEL.open("rb") as stream:
            upload = web.post("/ui/new", files={"model": (MODEL.name, stream)})
        assert upload.status_code == 403 and "security token" in upload.text
        csrf = web.cookies["edge_un_csrf"]  # a new one came with the session
        with MODEL.open("rb") as stream:
            bad = web.post(f"/ui/new?csrf={csrf}", files={"model": (MODEL.name, stream)},
                           data={"targets": "npu9000"})  # fmt: skip
        assert bad.status_code == 422 and "npu9000" in bad.text  # the API's checks, as a page
        assert web.get("/ui/").text.count('<tr id="job-') == 0
