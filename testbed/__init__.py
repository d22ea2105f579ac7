"""A real edge-un service on this machine, for the tests and the benchmarks (not part of the
product: never installed, never imported by it): PostgreSQL and Redis servers
(:mod:`testbed.servers`), the API server and Celery workers as processes, and what a client
does with them (:mod:`testbed.live`); and tiny models of the transformers families users bring,
with their data and exports (:mod:`testbed.hf_families`)."""
