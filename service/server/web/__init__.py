"""The web page for people, served beside the API by the same app under ``/ui``: sign in with a
token, your jobs with their progress, an upload form, each job's report and files.
Server-rendered, no script, nothing loaded from elsewhere. Modules: session (cookies, CSRF),
pages (the HTML), routes (the FastAPI routes)."""
