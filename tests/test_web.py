"""The web page for people (/ui) in the system's Chromium, against a real server.

Signed in with a token, a person uploads the bundled UN ViT, watches the job finish on the page
that refreshes itself, opens the report, and downloads an artifact whose sha256 is the one the
report lists; with another token the same browser sees none of it. Around that, over plain HTTP:
the Content-Security-Policy of report.html on every page, and forms refused without their CSRF
token or from another origin. Under CI=true a missing Chromium fails the test, never skips it.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator

import httpx
import pytest

from edge_un import examples
from service.job_states import FINISHED
from service.report_html import CSP
from testbed.live import LiveServer, ServiceMode, upload_fast, wait_for

from .service_live import is_problem

MODEL = examples.path("vit-mnist-un")
SERVER_ENV = {"EDGE_UN_WORKERS": "1"}  # the conftest's server (and its browser, downloads)


@pytest.fixture(scope="module")
def service_mode() -> ServiceMode:
    """The conftest's server in the local queue mode only (the web pages only speak HTTP)."""
    return ServiceMode("local")


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
    wait_until(lambda: seen(f"#job-{job_id} .state") in FINISHED, 300, "finished on the list")
    assert states[-1] == "succeeded", text(browser, "main")
    assert "running" in states, states  # watched while it ran, not only once it was done
    assert browser.execute_script("return window.performance.timeOrigin") != loaded
    assert text(browser, f"#job-{job_id} .progress") == "100 %"
    # no horizontal scroll bar on a laptop's screen
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    )
    assert severe(browser) == []
    # each target's verdict at a glance, on the list and first on the job's page, as the
    # report says it
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {alice}"}) as api:
        report = api.get(f"/v1/conversions/{job_id}/report").json()
    cpu = report["targets"]["cpu"]
    agreement = f"{100 * cpu['drift']['agreement']:.1f} %"
    assert text(browser, f"#job-{job_id} .verdict") == f"cpu {cpu['status']} {agreement}"
    browser.get(job_url)
    assert text(browser, "#job-state").startswith("succeeded · 100 %"), text(browser, "main")
    cells = browser.execute_script(
        "return [...document.querySelectorAll('#verdict-table tbody tr[data-target] td')]"
        ".map(c => c.textContent);"
    )
    p50 = min(cpu["latency"], key=lambda timing: timing["threads"])["p50_ms"]
    drop = f"{cpu['drift']['top1_drop_pts']:.1f} pt"
    int16 = cpu["int16_tensors"]
    precision = f"{len(int16)} tensors int16" if int16 else "pure int8"
    assert cells == [
        "cpu",
        cpu["status"],
        agreement,
        drop,
        precision,
        f"{p50:.3f} (onnxruntime)",
        "-",
    ]

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
        assert "Secure" not in cookie  # plain HTTP, no EDGE_UN_PUBLIC_URL: a browser drops it
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


def test_behind_a_tls_proxy_forms_come_from_the_public_url(tmp_path) -> None:
    """EDGE_UN_PUBLIC_URL=https://x.example, as behind a TLS proxy: uvicorn sees plain HTTP on
    127.0.0.1, the browser is at https://x.example. A sign-in from there is accepted and its
    cookies are Secure; one whose Origin is the address uvicorn sees is another site's."""
    live = LiveServer(tmp_path / "data", EDGE_UN_PUBLIC_URL="https://x.example").start()
    try:
        token = live.token("proxied")
        # by hand: httpx keeps Secure cookies from a plain-HTTP server, and never sends them
        with httpx.Client(base_url=live.url) as web:
            page = web.get("/ui/signin")
            (csrf_cookie,) = page.headers.get_list("set-cookie")
            assert "Secure" in csrf_cookie and csrf_cookie.startswith("edge_un_csrf=")
            csrf = csrf_cookie.split(";")[0].split("=", 1)[1]
            form = {"token": token, "csrf": csrf}
            jar = {"Cookie": f"edge_un_csrf={csrf}"}
            direct = web.post("/ui/signin", data=form, headers={**jar, "Origin": live.url})
            assert direct.status_code == 403 and "another site" in direct.text
            assert not direct.headers.get_list("set-cookie")
            signed = web.post("/ui/signin", data=form,
                              headers={**jar, "Origin": "https://x.example"})  # fmt: skip
            assert signed.status_code == 303, signed.text
            cookies = {c.split("=")[0]: c for c in signed.headers.get_list("set-cookie")}
            assert set(cookies) == {"edge_un_session", "edge_un_csrf"}
            assert all("Secure" in c and "HttpOnly" in c for c in cookies.values()), cookies
            # a Referer names the page's origin as well, when there is no Origin
            referer = {**jar, "Referer": "https://x.example/ui/signin"}
            referred = web.post("/ui/signin", data=form, headers=referer)
            assert referred.status_code == 303
    finally:
        live.stop()


def test_a_form_of_too_many_fields_is_a_400(server) -> None:
    """parse_qs refuses more than 8 fields with a ValueError: the page's 400, never a 500."""
    token = server.token("many-fields")
    with httpx.Client(base_url=server.url) as web:
        web.get("/ui/signin")
        csrf = web.cookies["edge_un_csrf"]
        crowded = {"token": token, "csrf": csrf, **{f"f{i}": "x" for i in range(9)}}
        refused = web.post("/ui/signin", data=crowded)
        assert refused.status_code == 400 and "more than 8 fields" in refused.text
        assert "edge_un_session" not in web.cookies
        assert web.post("/ui/signin", data={"token": token, "csrf": csrf}).status_code == 303
        csrf = web.cookies["edge_un_csrf"]
        for path in ("/ui/signout", "/ui/jobs/nope/cancel"):
            answer = web.post(path, data={"csrf": csrf, **{f"f{i}": "x" for i in range(9)}})
            assert answer.status_code == 400 and "more than 8 fields" in answer.text, path
            assert answer.headers["content-security-policy"] == CSP


@pytest.fixture(scope="module")
def finished_job(server: LiveServer) -> tuple[str, str]:
    """(token, id) of a quick conversion that succeeded, made over the API."""
    token = server.token("erin")
    with server.client(token) as api:
        created = upload_fast(api)
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        wait_for(api, job_id, ("succeeded",), timeout=300)
    return token, job_id


@contextlib.contextmanager
def signed_in_web(server: LiveServer, token: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as web:
        web.get("/ui/signin")
        form = {"token": token, "csrf": web.cookies["edge_un_csrf"]}
        assert web.post("/ui/signin", data=form).status_code == 303
        assert "edge_un_session" in web.cookies
        yield web


def test_downloads_from_the_page_are_never_cached(server, finished_job) -> None:
    """The API's artifacts are immutable for a year; the page's copies of them are no-store
    (a signed-out browser must not keep them)."""
    token, job_id = finished_job
    name = "cpu/model_int8.onnx"
    with server.client(token) as api:
        original = api.get(f"/v1/conversions/{job_id}/artifacts/{name}")
    assert "immutable" in original.headers["cache-control"]
    with signed_in_web(server, token) as web:
        for path in (f"/artifacts/{name}", "/bundle.zip"):
            response = web.get(f"/ui/jobs/{job_id}{path}")
            assert response.status_code == 200, (path, response.text[:300])
            assert response.headers["cache-control"] == "no-store", path
            assert response.headers["content-security-policy"] == CSP, path
        assert web.get(f"/ui/jobs/{job_id}/artifacts/{name}").content == original.content
        # a revalidation of the API's ETag is not the way back to a cached copy either
        etag = original.headers["etag"]
        again = web.get(f"/ui/jobs/{job_id}/artifacts/{name}", headers={"If-None-Match": etag})
        assert again.headers["cache-control"] == "no-store"


def test_cancel_on_the_page_never_deletes_a_finished_job(server, finished_job) -> None:
    """The page's cancel is the API's cancel: a finished job is a 409 page, and it stays, files
    and all (the page used to cancel through DELETE, which deletes what finished meanwhile)."""
    token, job_id = finished_job
    with signed_in_web(server, token) as web:
        answer = web.post(f"/ui/jobs/{job_id}/cancel", data={"csrf": web.cookies["edge_un_csrf"]})
        assert answer.status_code == 409, answer.text[:300]
        assert "already succeeded: nothing to cancel" in answer.text
    with server.client(token) as api:
        assert api.get(f"/v1/conversions/{job_id}").json()["state"] == "succeeded"
        files = api.get(f"/v1/conversions/{job_id}/artifacts")
        assert files.status_code == 200 and files.json()
        is_problem(api.post(f"/v1/conversions/{job_id}/cancel"), 409)
