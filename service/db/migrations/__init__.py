"""Alembic migrations of the service database (run through service.db.upgrade)."""
