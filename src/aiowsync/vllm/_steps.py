"""One vLLM server's steps in a send: the calls that pause it, load a version, label it,
take it back and resume it, each within the send's deadline (what puts a server back as it
was runs whatever the time)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import httpx

from ._http import VLLMServerError, VLLMServerTimeout, request

__all__ = ["ENGINE_ERROR", "RESUME_RETRY_S", "Server", "Steps", "may_hold"]

log = logging.getLogger("aiowsync.vllm")

ENGINE_ERROR = 500
"""The status vLLM answers a weight-transfer route with when its workers ran the call and
one of them raised."""
RESUME_RETRY_S = 0.1
"""The first pause before a failed ``resume`` is tried again (doubling, up to a second)."""


class Server:
    """One server: its URL, its workers' receiver indices, the version it serves."""

    def __init__(self, url: str, first: int, size: int) -> None:
        self.url = url
        self.first = first
        self.size = size
        self.version: int | None = None

    @property
    def workers(self) -> range:
        return range(self.first, self.first + self.size)


class Steps:
    """The calls of a send to one server at a time, on the servers' shared HTTP client."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        """The limit of one call."""
        self.client: httpx.AsyncClient | None = None
        """Set while the servers are attached."""
        self.deadline: float | None = None
        """The deadline of the send under way (``time.monotonic()``), if it has one."""
        self.pause_seconds: dict[str, float] = {}
        """Per server, how long its last version change kept it from generating."""

    async def load(self, server: Server, version: int) -> None:
        try:
            await self.call(server, "start_weight_update")
        except VLLMServerError as exc:
            if "already active" not in str(exc):
                raise
            # An update left open (a trainer died between its calls, or a take-back did not
            # reach the server): undo what it loaded, never labelled, then end it and start
            # again. A bare end would keep that version as the one to go back to.
            await self.take_back_quietly(server)
            await self.call(server, "start_weight_update")
        await self.call(server, "update_weights", {"update_info": {"version": version}})

    async def label(self, server: Server, version: int, *, always: bool = False) -> None:
        await self.call(
            server, "finish_weight_update", {"weight_version": str(version)}, always=always
        )
        server.version = version

    async def resume(self, server: Server, started: float, *, quiet: bool) -> None:
        """Resume ``server`` (whatever the deadline); with ``quiet``, a failure is logged,
        not raised (the send fails with the error that came first)."""
        try:
            await self._resume_surely(server)
        except VLLMServerError as exc:
            if not quiet:
                raise
            log.warning("%s: could not resume it: %s", server.url, exc)
        finally:
            self.pause_seconds[server.url] = time.perf_counter() - started

    async def _resume_surely(self, server: Server) -> None:
        """``resume``, tried again (within :attr:`timeout`) while the server answers with an
        error or not at all: a server left paused serves nobody until the next send."""
        end = time.monotonic() + self.timeout
        pause = RESUME_RETRY_S
        while True:
            try:
                await self.call(
                    server, "resume", always=True, limit=max(0.1, end - time.monotonic())
                )
                return
            except VLLMServerError:
                if time.monotonic() + pause >= end:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    async def take_back_all(self, servers: Iterable[Server]) -> None:
        await asyncio.gather(*(self.take_back_quietly(s) for s in servers))

    async def take_back_quietly(self, server: Server) -> None:
        try:
            await self.take_back(server)
        except VLLMServerError as exc:
            log.warning("%s: could not take its previous version back: %s", server.url, exc)

    async def take_back(self, server: Server) -> None:
        """A server that may hold a version it was not to keep (its load failed, ran past
        the deadline or was cancelled, or its fleet could not take it): back to what it
        served. Its workers wait for a load still under way, then undo it (to the version
        before, or to the weights the server started with); one that holds nothing unlabelled
        does nothing."""
        back = -1 if server.version is None else server.version
        info = {"update_info": {"version": back, "take_back": True}}
        refused = None
        try:
            await self.call(server, "update_weights", info, always=True)
        except VLLMServerError as exc:
            if exc.status != ENGINE_ERROR:
                # It may not have reached the workers: ending the update now would make
                # what they loaded the version to go back to. It stays open, and the next
                # send's load takes it back first.
                raise
            # The workers ran it, and one refused: on a server of several workers, one whose
            # own load failed has no update open (it put back its weights itself).
            refused = exc
        try:
            await self.call(server, "finish_weight_update", {}, always=True)
        except VLLMServerError:
            if refused is None:
                raise
        if refused is not None:
            raise refused

    async def call(
        self,
        server: Server,
        route: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
        limit: float | None = None,
        always: bool = False,
    ) -> dict[str, Any]:
        """POST ``route``; within the send's deadline unless ``always`` (what puts a server
        back as it was runs whatever the time)."""
        if self.deadline is not None and not always:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise VLLMServerTimeout(server.url, route, "the send's deadline passed first")
            limit = min(limit or self.timeout, left)
        try:
            return await self.request("POST", server.url, route, body, params=params, limit=limit)
        except VLLMServerError as exc:
            if self.deadline is not None and not always and time.monotonic() >= self.deadline:
                raise VLLMServerTimeout(server.url, route, exc.detail, exc.status) from exc
            raise

    async def request(
        self,
        method: str,
        url: str,
        route: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
        limit: float | None = None,
    ) -> dict[str, Any]:
        client = self.client
        if client is None:
            raise RuntimeError("the servers are not attached (async with servers.attach(scheme))")
        return await request(
            client, method, url, route, body, params=params, limit=limit or self.timeout
        )


def may_hold(step: str, error: BaseException | None, workers: int) -> bool:
    """Whether a server of ``workers`` workers whose switch failed at ``step`` with ``error``
    may hold the version, unlabelled: once its load was asked for, unless a one-worker server
    answered the load with an error (its worker then put back what it had). On a server of
    several workers (tensor parallel), the others may have loaded it even so: vLLM answers
    with the first worker's error."""
    if error is None or step == "label":
        return True
    answered = isinstance(error, VLLMServerError) and error.status is not None
    return step == "load" and (not answered or workers > 1)
