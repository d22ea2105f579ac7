"""``Client``: the service's HTTP API from Python (see the package's docstring)."""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from ..job_states import FINISHED
from ..schemas import ArtifactOut, JobOut, JobPage, TargetOut
from .errors import ServiceError, problem_error, reason
from .files import inside, range_start, sha256_file, zip_hf_directory

if TYPE_CHECKING:
    from quant.report import Report

RETRY_STATUSES = frozenset({503})
# Reads wait longer than connects: an upload's answer comes after the server checked the files.
DEFAULT_TIMEOUT = httpx.Timeout(30.0, read=600.0)
Progress = Callable[[JobOut], None]
FileProgress = Callable[[str, int, int], None]  # artifact name, bytes so far, bytes in all
T = TypeVar("T")


class Client:
    """The service at ``server`` (e.g. ``http://127.0.0.1:8000``) with an API token (None for
    a server started with EDGE_UN_AUTH=none). Use as a context manager, or ``close()``."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        on_retry: Callable[[str, float], None] | None = None,
    ) -> None:
        """``retries`` after the first try, waiting ``backoff_s`` doubled each time (at most
        ``max_backoff_s``); ``on_retry(why, seconds)`` before each wait (the CLI says so)."""
        self.server = _base_url(server)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._wait = sleep
        self._on_retry = on_retry
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.server, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------------------

    def _backoff(self, attempt: int, why: str, response: httpx.Response | None = None) -> None:
        retry_after = response.headers.get("retry-after", "") if response is not None else ""
        if retry_after.isdigit():
            delay = min(float(retry_after), self.max_backoff_s)
        else:
            delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
        if self._on_retry is not None:
            self._on_retry(why, delay)
        self._wait(delay)

    def _request(
        self,
        method: str,
        path: str,
        *,
        resend: bool = True,
        build: Callable[[contextlib.ExitStack], dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request, retried on a 503 and on connection errors; ``resend`` False: a
        request that may have reached the server (an upload) is re-sent only if the connection
        failed before it was sent. ``build`` makes fresh arguments per attempt (open files)."""
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            with contextlib.ExitStack() as stack:
                arguments = {**kwargs, **(build(stack) if build else {})}
                try:
                    response = self._http.request(method, path, **arguments)
                except httpx.TransportError as error:
                    if last or not (resend or isinstance(error, httpx.ConnectError)):
                        raise ServiceError(
                            f"{method} {self.server}{path} failed: {reason(error)}"
                        ) from None
                    self._backoff(attempt, reason(error))
                    continue
            if response.status_code in RETRY_STATUSES and not last:
                self._backoff(attempt, f"HTTP {response.status_code}", response)
                continue
            _check(response, self.server)
            return response
        raise AssertionError("unreachable")  # the loop returns or raises

    # -- jobs --------------------------------------------------------------------------------

    def submit(
        self,
        model: str | Path,
        *,
        targets: str | Sequence[str] | None = None,
        calib: str | Path | None = None,
        eval: str | Path | None = None,
        config: str | Path | None = None,
        model_data: Sequence[str | Path] = (),
        max_drift: float | None = None,
    ) -> JobOut:
        """Upload a model (a file, or a Hugging Face directory: zipped on the way) and its
        optional files; the queued job."""
        model = Path(model)
        files = {"config": config, "calib": calib, "eval": eval}
        data: dict[str, str] = {}
        if targets is not None:
            data["targets"] = targets if isinstance(targets, str) else ",".join(targets)
        if max_drift is not None:
            data["max_drift"] = repr(float(max_drift))
        with tempfile.TemporaryDirectory(prefix="edge-un-submit-") as scratch:
            if model.is_dir():
                model = zip_hf_directory(model, Path(scratch) / f"{model.name}.zip")
            for path in [model, *(Path(p) for p in model_data), *filter(None, files.values())]:
                if not Path(path).is_file():
                    raise FileNotFoundError(f"{path}: no such file")

            def build(stack: contextlib.ExitStack) -> dict[str, Any]:
                def part(path: str | Path) -> tuple[str, Any]:
                    return Path(path).name, stack.enter_context(Path(path).open("rb"))

                parts = [("model", part(model))]
                parts += [("model_data", part(p)) for p in model_data]
                parts += [(name, part(p)) for name, p in files.items() if p is not None]
                return {"files": parts, "data": data}

            response = self._request("POST", "/v1/conversions", resend=False, build=build)
        return _parse(response, JobOut)

    def job(self, job_id: str) -> JobOut:
        return _parse(self._request("GET", _job_path(job_id)), JobOut)

    def jobs(self, limit: int = 20, offset: int = 0) -> JobPage:
        """One page of this token's jobs, newest first."""
        params = {"limit": limit, "offset": offset}
        response = self._request("GET", "/v1/conversions", params=params)
        return _parse(response, JobPage)

    def all_jobs(self) -> Iterator[JobOut]:
        offset = 0
        while True:
            page = self.jobs(limit=100, offset=offset)
            yield from page.items
            offset += len(page.items)
            if page.next is None or not page.items:
                return

    def wait(
        self,
        job_id: str,
        progress: Progress | None = None,
        *,
        interval_s: float = 1.0,
        timeout_s: float | None = None,
    ) -> JobOut:
        """Poll until the job finished (succeeded, partial, failed or cancelled);
        ``progress(job)`` after each poll (its ``stage`` and ``percent``). Returns the finished
        job, whatever its state."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if progress is not None:
                progress(job)
            if job.state in FINISHED:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise ServiceError(
                    f"the conversion {job_id} is still {job.state} ({job.stage or 'waiting'}, "
                    f"{job.percent:g} %) after {timeout_s:g} s"
                )
            self._wait(interval_s)

    def cancel(self, job_id: str) -> JobOut:
        """Cancel a queued or running job; the cancelled job. A finished one is a ServiceError
        (409) and stays as it is: the server's cancel never deletes (``delete`` does)."""
        return _parse(self._request("POST", f"{_job_path(job_id)}/cancel"), JobOut)

    def delete(self, job_id: str) -> None:
        """Delete a finished job and its files (cancels one still queued or running)."""
        self._request("DELETE", _job_path(job_id))

    def targets(self) -> list[TargetOut]:
        return _parse(self._request("GET", "/v1/targets"), list[TargetOut])

    # -- results -----------------------------------------------------------------------------

    def report(self, job_id: str) -> Report:
        from quant.report import Report

        response = self._request("GET", f"{_job_path(job_id)}/report")
        return _parse(response, Report, " (or a newer one: upgrade edge-un)")

    def report_html(self, job_id: str) -> str:
        return self._request("GET", f"{_job_path(job_id)}/report.html").text

    def artifacts(self, job_id: str) -> list[ArtifactOut]:
        response = self._request("GET", f"{_job_path(job_id)}/artifacts")
        return _parse(response, list[ArtifactOut])

    def download(
        self,
        job_id: str,
        dest: str | Path,
        *,
        names: Sequence[str] | None = None,
        progress: FileProgress | None = None,
    ) -> list[Path]:
        """Every artifact (or those ``names``) into ``dest``, under its artifact path. Each file
        is checked against the sha256 the artifact list gives and, for the files a target made,
        the report gives; an interrupted download resumes where it stopped (Range), in this
        call or the next one; a file already there with the right digest is kept."""
        dest = Path(dest)
        listing = self.artifacts(job_id)
        reported = {
            artifact.name: artifact.sha256
            for target in self.report(job_id).targets.values()
            for artifact in target.artifacts
        }
        chosen = [a for a in listing if names is None or a.name in names]
        if names is not None and (unknown := set(names) - {a.name for a in chosen}):
            raise ServiceError(f"the conversion {job_id} has no artifact {sorted(unknown)[0]!r}")
        paths = []
        for artifact in chosen:
            if reported.get(artifact.name, artifact.sha256) != artifact.sha256:
                raise ServiceError(
                    f"{artifact.name}: the report's sha256 and the server's artifact list "
                    "disagree; the job's files changed after it finished"
                )
            paths.append(self._fetch(job_id, artifact, inside(dest, artifact.name), progress))
        return paths

    def _fetch(
        self, job_id: str, artifact: ArtifactOut, path: Path, progress: FileProgress | None
    ) -> Path:
        same_size = path.is_file() and path.stat().st_size == artifact.bytes
        if same_size and sha256_file(path) == artifact.sha256:
            return path  # downloaded before
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        url = f"{_job_path(job_id)}/artifacts/{artifact.name}"
        for attempt in range(self.retries + 1):
            have = partial.stat().st_size if partial.is_file() else 0
            if have > artifact.bytes:
                partial.unlink()
                have = 0
            if have == artifact.bytes:
                break
            # If-Range: a part of another file of this name is never continued
            resume = {"Range": f"bytes={have}-", "If-Range": f'"{artifact.sha256}"'}
            headers = resume if have else {}
            try:
                with self._http.stream("GET", url, headers=headers) as response:
                    if response.status_code in RETRY_STATUSES and attempt < self.retries:
                        self._backoff(attempt, f"HTTP {response.status_code}", response)
                        continue
                    if not response.is_success:
                        response.read()
                        _check(response, self.server)
                    resumed = response.status_code == 206 and range_start(response) == have
                    with partial.open("ab" if resumed else "wb") as out:
                        done = have if resumed else 0
                        # as it arrives (no chunk size: httpx would hold up to a chunk back,
                        # and a connection lost meanwhile would lose it for the resume)
                        for chunk in response.iter_bytes():
                            out.write(chunk)
                            done += len(chunk)
                            if progress is not None:
                                progress(artifact.name, done, artifact.bytes)
            except httpx.TransportError as error:  # keep what arrived; the next try resumes
                if attempt == self.retries:
                    raise ServiceError(
                        f"downloading {artifact.name} failed after {attempt + 1} tries: "
                        f"{reason(error)}; run the download again to resume"
                    ) from None
                self._backoff(attempt, reason(error))
        if not partial.is_file():  # a 0-byte artifact (or none of it arrived)
            partial.touch()
        digest = sha256_file(partial)
        if digest != artifact.sha256:
            partial.unlink()
            raise ServiceError(
                f"{artifact.name}: downloaded sha256 {digest[:16]}... is not the reported "
                f"{artifact.sha256[:16]}...; removed it, download again"
            )
        partial.replace(path)
        return path


def _check(response: httpx.Response, server: str) -> None:
    """Raise the ServiceError of any answer but a 2xx. A 3xx too: the client follows no
    redirect (it would re-send the token, or an upload, to wherever it points), so it names
    the address to give as --server instead (a proxy's 301 from http:// to https://, say)."""
    if response.is_success:
        return
    if not response.is_redirect:  # an error, or a 3xx without a Location
        raise problem_error(response)
    request = response.request
    target = request.url.join(response.headers["location"])
    # the address without this request's API path (and query): what --server should be
    api_path = request.url.path[len(httpx.URL(server).path.rstrip("/")) :]
    bare = str(target.copy_with(query=None, fragment=None))
    suggested = bare[: -len(api_path)] if api_path and bare.endswith(api_path) else str(target)
    raise ServiceError(
        f"{request.method} {request.url}: the server redirected (HTTP {response.status_code}) "
        f"to {target}; use {suggested} as --server",
        status=response.status_code,
    )


@functools.cache
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def _parse(response: httpx.Response, kind: type[T], hint: str = "") -> T:
    """A 2xx answer read as ``kind``: one that is not (a proxy's page, a server of another
    version) is a ServiceError naming what came, never pydantic's many lines."""
    try:
        return _adapter(kind).validate_json(response.content)
    except ValueError as error:  # pydantic's ValidationError is a ValueError too
        count = error.error_count() if isinstance(error, ValidationError) else 1
        args = getattr(kind, "__args__", ())
        name = f"list of {args[0].__name__}" if args else kind.__name__
        media = response.headers.get("content-type", "no Content-Type").split(";")[0]
        url = response.request.url
        raise ServiceError(
            f"the answer to {response.request.method} {url} (HTTP {response.status_code}, "
            f"{media}) is not the {name} this client reads ({count} problem(s)); is "
            f"{url.scheme}://{url.netloc.decode('ascii', 'replace')} an edge-un service?{hint}",
            status=response.status_code,
        ) from None


def _base_url(server: str) -> str:
    """``server`` without a trailing slash, refused at once (not retried) unless it is an
    http(s) address with a host: a typo never waits through the backoff."""
    try:
        url = httpx.URL(server)
    except (httpx.InvalidURL, TypeError):
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise ServiceError(
            f"{server[:80]!r} is not a service address: give http://HOST:PORT (or https://)"
        )
    return server.rstrip("/")


def _job_path(job_id: str) -> str:
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ServiceError(f"{job_id!r} is not a job id")
    return f"/v1/conversions/{job_id}"
