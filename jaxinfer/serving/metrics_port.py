"""The metrics port (`--metrics-port`): `GET /metrics` answers a registry's Prometheus text, any other path 404, in
a daemon thread of its own (`http.server`, one thread per connection)."""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry  # set on the subclass `MetricsPort` makes

    def _answer(self, with_body: bool) -> None:
        if urllib.parse.urlsplit(self.path).path != METRICS_PATH:
            self.send_error(404, f"not found: this port serves {METRICS_PATH} only")
            return
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(with_body=False)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        logger.debug("metrics port: " + format, *args)


class MetricsPort:
    """Serves `registry` on host:port until `close()`.

    Args:
      registry: the metrics to answer `/metrics` with (collected at each request).
      port: TCP port; 0 picks a free one (see `port`).
      host: address to bind, IPv4 or IPv6 (`[::1]` or `::1`).

    Raises:
      OSError: the address cannot be bound (in use, or not an address of this machine).
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
        name = host[1:-1] if host.startswith("[") else host
        family, _, _, _, address = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_cls = type("_Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
        handler = type("_RegistryHandler", (_Handler,), {"registry": registry})
        self._server = server_cls(address, handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="jaxinfer-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops serving and closes the port (waits for the serving loop, at most about half a second)."""
        self._server.shutdown()
        self._server.server_close()
