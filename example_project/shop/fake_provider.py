"""A stand-in for the external payments provider, for the demo and the tests (the one mocked boundary).

A real HTTP server on 127.0.0.1. ``POST /charges`` fails with 503 (``Retry-After`` absent) the first
``failures`` times for each Idempotency-Key, then answers 201 with a charge id; the same key never charges
twice, as a real provider's idempotency keys promise.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FlakyProvider:
    def __init__(self, *, failures: int = 2) -> None:
        self.failures = failures
        self.calls: Counter[str] = Counter()
        self.charges: dict[str, dict[str, Any]] = {}
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                key = self.headers.get("Idempotency-Key", "")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                provider.calls[key] += 1
                if provider.calls[key] <= provider.failures:
                    self._answer(503, {"error": "provider busy"})
                    return
                charge = provider.charges.setdefault(key, {"id": f"ch_{len(provider.charges) + 1}", **body})
                self._answer(201, charge)

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
