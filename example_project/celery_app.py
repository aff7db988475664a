"""The example project's Celery app, configured from Django settings (``CELERY_*``).

Named celery_app.py, not celery.py: manage.py puts this folder first on sys.path, where a celery.py would
shadow the celery package.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
