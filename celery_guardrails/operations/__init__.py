"""Operations tooling: what operators read and run: the deployment audit and what it reads of the source,
``status``, Prometheus metrics and collectors, the activity kept for the dashboard, owner alerts, and the
``celery -A proj guardrails`` commands. Nothing here is on a delivery's path except the counters it records.
"""
