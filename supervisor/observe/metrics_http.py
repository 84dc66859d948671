"""The HTTP side of the metrics endpoint: imported only when `[metrics] listen` is set (`http.server`
costs start-up time, and most jobs are scraped by nothing).

It knows nothing of metrics: the owner sets `render` (the body) and `content_type` on the server.
"""
from __future__ import annotations

import http.server
import socket
import socketserver
from collections.abc import Callable
from typing import Any

__all__ = ["Server"]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Server
    timeout = 10  # a client that never finishes its request must not hold a thread forever

    def do_GET(self) -> None:  # http.server's naming
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body, ctype, code = self.server.render().encode(), self.server.content_type, 200
            except Exception as exc:  # noqa: BLE001 - a rendering bug must cost one scrape, not a traceback per request
                body, ctype, code = f"cannot render metrics: {exc!r}\n".encode(), "text/plain; charset=utf-8", 500
        elif path == "/":
            body, ctype, code = b"fsdp-supervisor: see /metrics\n", "text/plain; charset=utf-8", 200
        else:
            body, ctype, code = b"not found\n", "text/plain; charset=utf-8", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not events worth logging
        pass


class Server(http.server.ThreadingHTTPServer):
    """Serves `render()` on GET /metrics from daemon threads."""

    daemon_threads = True
    render: Callable[[], str]
    content_type: str

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall start-up; we need no name.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
