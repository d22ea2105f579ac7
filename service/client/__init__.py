"""A Python client of the conversion service, on httpx, typed with the API's own schemas.

    from service.client import Client

    with Client("http://127.0.0.1:8000", token) as client:
        job = client.submit("model.safetensors", targets="cpu,imx93")
        job = client.wait(job.id, progress=lambda job: print(job.stage, job.percent))
        report = client.report(job.id)              # quant.report.Report
        paths = client.download(job.id, "out/")     # resumable, checked against the sha256s

Every answer is parsed into the pydantic models the server answers with
(``service.schemas``; the report into ``quant.report.Report``), so a client and a server
of different versions disagree loudly, at the field. Every error is one ``ServiceError`` that
carries the server's problem+json (RFC 9457) ``detail``. A 503 and a lost connection are
retried with exponential backoff (honouring ``Retry-After``); an upload is re-sent only when
the connection failed before the server could have read it, so a retry never makes two jobs.
"""

from __future__ import annotations

from ..job_states import FINISHED
from .client import Client
from .errors import ServiceError
from .files import sha256_file, zip_hf_directory

__all__ = ["FINISHED", "Client", "ServiceError", "sha256_file", "zip_hf_directory"]
