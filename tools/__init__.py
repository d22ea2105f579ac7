"""Maintenance scripts of the repository (not part of the product, never imported by it): each
is run from the repository's root as ``.venv/bin/python tools/NAME.py``."""
