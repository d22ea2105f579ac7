"""Standing benchmarks of the service: load, Celery fan-out and scale, recovery from killed
workers, and the Docker images."""
