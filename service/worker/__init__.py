"""Running conversions: the job process (``job_process``: one conversion, its limits;
``steps``: what it runs and records; ``failures``: why one failed) and the queues that start
it: the local queue (``queue``: a fork server inside the API process) and Celery
(``celery_app``: the worker, ``edge-un worker``; ``celery_queue``: the API's side). Imports
nothing of the server: the server starts its queue from here."""
