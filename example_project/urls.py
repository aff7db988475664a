from django.contrib import admin
from django.urls import include, path

from example_project.shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("guardrails/", include("django_celery_guardrails.urls")),
    path("orders/<int:order_id>/receipt", views.send_receipt_view, name="send-receipt"),
    path("orders/<int:order_id>/charge", views.charge_order_view, name="charge-order"),
    path("reports/<int:report_id>", views.report_view, name="report"),
]
