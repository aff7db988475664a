"""The same project before a deployment: its workers run tests.kit_proj.old_tasks."""

from tests.kit_proj.app import make_app

app = make_app("kit_tests_old", ["tests.kit_proj.old_tasks"])
