"""An HTTP twin of a vLLM server's weight-transfer routes, for fast tests of the trainer's
steps (the real servers are in tests/integrations/vllm_server).

It keeps what a real server with aiowsync's engine keeps: paused or not, the weights it
serves (a version number, ``None`` for the server's own), a version loaded and not yet
labelled, and its ``weight_version``. Calls to the engine run one at a time, as vLLM's engine
core takes them; each call's start and end are recorded.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ENGINE_ROUTES = ("start_weight_update", "update_weights", "finish_weight_update")


class VLLMRoutes:
    def __init__(self) -> None:
        self.paused = False
        self.serves: int | None = None
        """The version whose weights the server generates with (None: its own)."""
        self.before: int | None = None
        """What it served before the version loaded and not yet labelled."""
        self.pending = False
        self.label: str | None = None
        self.active = False
        self.world_size = 1
        self.delays: dict[str, float] = {}
        """Seconds the next call of a route takes (once)."""
        self.fail: dict[str, str] = {}
        """The error the next call of a route answers (once): the engine's (500) for its
        routes, which then ran and changed nothing, else a proxy's (503)."""
        self.calls: list[tuple[str, float, float, dict[str, Any]]] = []
        """(route, start, end, body) of each call, in the order they ended."""
        self._engine = threading.Lock()
        routes = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                route = self.path.split("?")[0].strip("/")
                answers = {
                    "get_world_size": {"world_size": routes.world_size},
                    "is_paused": {"is_paused": routes.paused},
                    "weight_info": {"weight_version": routes.label},
                }
                self._answer(200, answers.get(route, {}))

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                route, _, query = self.path.strip("/").partition("?")
                status, answer = routes.handle(route, body, query)
                self._answer(status, answer)

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=10)

    def handle(self, route: str, body: dict[str, Any], query: str) -> tuple[int, dict[str, Any]]:
        start = time.monotonic()
        if route in ENGINE_ROUTES:
            with self._engine:
                status, answer = self._engine_call(route, body)
        else:
            time.sleep(self.delays.pop(route, 0.0))
            status, answer = 200, {}
            if route in self.fail:
                status, answer = 503, {"error": {"message": self.fail.pop(route)}}
            elif route == "pause":
                self.paused = True
            elif route == "resume":
                self.paused = False
        self.calls.append((route, start, time.monotonic(), body))
        return status, answer

    def _engine_call(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        time.sleep(self.delays.pop(route, 0.0))
        if route in self.fail:
            return 500, {"error": {"message": self.fail.pop(route)}}
        if route == "start_weight_update":
            if self.active:
                return 400, {"error": {"message": "a weight update is already active"}}
            self.active = True
        elif route == "update_weights":
            info = body["update_info"]
            if info.get("take_back"):
                if self.pending:
                    self.serves, self.pending = self.before, False
            elif not self.pending:
                self.before, self.serves, self.pending = self.serves, info["version"], True
        else:  # finish_weight_update
            self.active = self.pending = False
            if "weight_version" in body:
                self.label = body["weight_version"]
        return 200, {}

    def call(self, route: str, **where: Any) -> tuple[float, float]:
        """(start, end) of the last call of ``route`` whose update_info has ``where``."""
        for name, start, end, body in reversed(self.calls):
            info = body.get("update_info", {})
            if name == route and all(info.get(k) == v for k, v in where.items()):
                return start, end
        raise AssertionError(f"no call of {route} {where or ''}: {self.routes()}")

    def routes(self) -> list[str]:
        return [name for name, *_ in self.calls]
