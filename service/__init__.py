"""The edge-un service: HTTP API, jobs and storage, and the edge-un command line."""
