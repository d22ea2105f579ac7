"""The edge-un service, laid out by who runs it:

* ``server/``: the HTTP service, ``edge-un serve`` (FastAPI): ``app`` composes the API
  (``api/``, /v1, problem+json) and the web page (``web/``, /ui), both thin layers over the
  same plain functions (``job_actions``, ``intake`` with the upload checks in ``uploads/``);
* ``worker/``: the job process that runs one conversion, and the queues that start it (the
  local queue, inside the server; Celery workers, ``edge-un worker``);
* ``cli/``: the ``edge-un`` command line; ``client/``: the Python client (httpx, no server
  dependencies);
* beside them, what they share: ``settings``, ``db/`` and ``jobs`` (the job records and their
  state machine, ``job_states``), ``storage`` and ``upload_layout`` (a job's files),
  ``tokens``, ``errors`` (refusals), ``schemas`` (the API's wire format, which the client
  reads too), ``report_html`` and ``report_plots`` (report.html, written by ``convert`` and
  served by the server).

No folder imports another that imports it back (tests/test_architecture.py).
"""
