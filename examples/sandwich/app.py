"""A sandwich-rating service: the sample app `fauxmad demo` runs on machines in three regions.

Stdlib only. It listens on $PORT, answers GET / with its ratings and where it runs, GET /health
with 200, and POST /rate?sandwich=NAME&stars=N to add a rating.
"""

from __future__ import annotations

import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

RATINGS: dict[str, list[int]] = {"bocadillo de calamares": [5, 4], "vegemite toastie": [3], "bauru": [5]}


class Handler(BaseHTTPRequestHandler):
    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {"ok": True})
            return
        averages = {name: round(sum(stars) / len(stars), 2) for name, stars in RATINGS.items()}
        self._send(
            200,
            {
                "machine": os.environ.get("FAUXMAD_MACHINE_ID"),
                "region": os.environ.get("FAUXMAD_REGION"),
                "worker": os.environ.get("FAUXMAD_WORKER_ID"),
                "ratings": averages,
            },
        )

    def do_POST(self) -> None:
        query = parse_qs(urlparse(self.path).query)
        try:
            name, stars = query["sandwich"][0], int(query["stars"][0])
            if not 1 <= stars <= 5:
                raise ValueError
        except (KeyError, ValueError):
            self._send(400, {"error": "use /rate?sandwich=NAME&stars=1..5"})
            return
        RATINGS.setdefault(name, []).append(stars)
        self._send(200, {"sandwich": name, "ratings": len(RATINGS[name])})

    def log_message(self, format: str, *args: object) -> None:
        print(f"{self.command} {self.path} -> {args[1] if len(args) > 1 else ''}", flush=True)


def main() -> None:
    port = int(os.environ.get("PORT", "8080"))
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"sandwich ratings on port {port} ({os.environ.get('FAUXMAD_REGION', 'local')})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
