"""A stand-in for the external payments provider, for the demo and the tests (the one mocked boundary).

A real HTTP server on 127.0.0.1. ``POST /charges`` for an order listed in ``flaky`` fails with 503 that many
times, then answers 201 with a charge id; a request repeating an Idempotency-Key gets the same charge back and
never charges twice, as a real provider's idempotency keys promise. ``calls`` and ``charges`` count by order;
``cards`` keeps the card token each order was last charged with.

It stands in for the carrier and the warehouse too: ``POST /shipments`` books an order's parcel (201; an order
listed in ``busy_carrier`` first gets that many 429s, which say the request was not processed), ``POST
/warehouse`` tells the warehouse (201; 503 for an order in ``warehouse_down``). ``bookings`` counts the parcels
booked per order.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FlakyProvider:
    def __init__(self, *, flaky: dict[int, int] | None = None) -> None:
        self.flaky = dict(flaky or {})
        self.declined: set[int] = set()  # orders whose card the provider declines (402, permanent)
        self.calls: Counter[int] = Counter()
        self.by_key: dict[str, dict[str, Any]] = {}
        self.charges: Counter[int] = Counter()
        self.cards: dict[int, str] = {}  # the card token each order was last charged with
        self.busy_carrier: dict[int, int] = {}  # orders whose booking gets that many 429s first
        self.warehouse_down: set[int] = set()  # orders the warehouse answers 503 for
        self.carrier_calls: Counter[int] = Counter()
        self.bookings: Counter[int] = Counter()
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                key = self.headers.get("Idempotency-Key", "")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                order = int(body.get("order_id", 0))
                if self.path == "/shipments":
                    provider.carrier_calls[order] += 1
                    if provider.carrier_calls[order] <= provider.busy_carrier.get(order, 0):
                        self._answer(429, {"error": "too many requests"})
                        return
                    provider.bookings[order] += 1
                    self._answer(201, {"id": f"parcel_{order}_{provider.bookings[order]}"})
                    return
                if self.path == "/warehouse":
                    self._answer(503 if order in provider.warehouse_down else 201, {})
                    return
                provider.calls[order] += 1
                provider.cards[order] = str(body.get("card_token", ""))
                if order in provider.declined:
                    self._answer(402, {"error": "card declined"})
                    return
                if provider.calls[order] <= provider.flaky.get(order, 0):
                    self._answer(503, {"error": "provider busy"})
                    return
                if key not in provider.by_key:
                    provider.charges[order] += 1
                    provider.by_key[key] = {"id": f"ch_{len(provider.by_key) + 1}", **body}
                self._answer(201, provider.by_key[key])

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyProvider:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
