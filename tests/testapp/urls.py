"""The test project's URLs: the example project's, and a view that submits a job (tests/testapp/views.py)."""

from django.urls import path

from example_project.urls import urlpatterns as example_urlpatterns
from tests.testapp import views

urlpatterns = [
    *example_urlpatterns,
    path("reports/", views.submit_report, name="submit-report"),
]
