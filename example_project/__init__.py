"""A small Django shop that uses every guardrail; ``demo.py`` runs it end to end."""

from example_project.celery_app import app as celery_app

__all__ = ["celery_app"]
