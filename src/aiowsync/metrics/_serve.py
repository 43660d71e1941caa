"""``serve(port)``: a registry's metrics over HTTP, from a thread of their own."""

from __future__ import annotations

import threading
from types import TracebackType
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

__all__ = ["MetricsServer", "serve"]

STOP_WAIT_S = 5.0
"""How long :meth:`MetricsServer.close` waits for the server's thread to end."""


class MetricsServer:
    """What :func:`serve` returns: an HTTP server of the metrics, running until
    :meth:`close` (or the end of ``with``)."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        host, port = server.server_address[:2]
        self.port: int = int(port)
        """The port it listens on (the one chosen, when ``serve(0)``)."""
        self.host: str = str(host)
        """The address it listens on."""

    @property
    def url(self) -> str:
        """Where the metrics page is, e.g. ``http://127.0.0.1:9400/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(STOP_WAIT_S)
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url})"


def serve(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve ``registry`` (prometheus_client's default registry if None) at
    ``http://addr:port/metrics``, from a daemon thread, until the server is closed.

    Args:
        port: the port; 0 picks a free one (read it from ``.port``).
        addr: the address to listen on: loopback by default; ``"0.0.0.0"`` for a Prometheus
            server on another host (the page then is readable by anyone who can reach it).
        registry: what to serve.

    Raises:
        OSError: the port cannot be had.
    """
    registry = REGISTRY if registry is None else registry
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread)
