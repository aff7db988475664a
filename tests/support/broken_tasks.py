"""A project's task module that fails to import (tests/test_first_hour.py): its error must be named, not a 500."""

raise RuntimeError("the settings lack PAYMENTS_URL")
