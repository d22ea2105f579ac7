"""The HTTP conversion service (``edge-un serve``, ``python -m service.server``).

``app.create_app`` composes two faces over one set of plain functions: the API (``api/``:
/v1, bearer tokens, problem+json) and the web page for people (``web/``: /ui, a session
cookie, server-rendered HTML). Neither imports the other: both call ``job_actions`` (find,
read, cancel, delete a job), ``intake`` (accept an upload: ``uploads/`` checks its files) and
``downloads`` (an artifact, the bundle, report.html as responses), take the request's context
from ``deps``, and turn a refusal into a status through ``http_status``.
"""
