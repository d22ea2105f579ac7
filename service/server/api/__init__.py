"""The HTTP API (/v1, described at /docs): ``conversions`` and ``system`` (the routes), ``auth``
(bearer tokens), ``problems`` (every error as problem+json) and ``openapi`` (the document as
the API behaves). ``service.server.app`` mounts it beside the web page."""
