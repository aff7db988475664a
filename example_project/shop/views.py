import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from celery_guardrails import MissingTenantError, current_correlation_id, current_tenant
from django_celery_guardrails.jobs import accepted
from example_project.shop.tasks import build_report, charge_order, send_receipt


@csrf_exempt
@require_POST
def send_receipt_view(request: HttpRequest, order_id: int) -> JsonResponse:
    """Enqueue the receipt of an order; the request's tenant and X-Request-ID travel with the task."""
    try:
        result = send_receipt.delay(order_id)
    except MissingTenantError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse(
        {"task_id": result.id, "tenant": current_tenant(), "correlation_id": current_correlation_id()},
        status=202,
    )


@csrf_exempt
@require_POST
def charge_order_view(request: HttpRequest, order_id: int) -> JsonResponse:
    """Enqueue the charge of an order (amount in cents from ?amount=, the card token from a JSON body)."""
    body: dict[str, str] = {}
    if request.content_type == "application/json" and request.body:
        try:
            body = json.loads(request.body)
        except ValueError:
            return JsonResponse({"error": "the body is not JSON"}, status=400)
    try:
        result = charge_order.delay(order_id, int(request.GET.get("amount", "0")), body.get("card_token", ""))
    except MissingTenantError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"task_id": result.id, "tenant": current_tenant()}, status=202)


@csrf_exempt
@require_POST
def report_view(request: HttpRequest, report_id: int) -> JsonResponse:
    """Submit a tenant's report as a job: 202 with the job's status URL (guardrails/jobs/<id>/) to poll."""
    try:
        job = build_report.submit(report_id, seconds=float(request.GET.get("seconds", "1")))
    except MissingTenantError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return accepted(job, request=request)
