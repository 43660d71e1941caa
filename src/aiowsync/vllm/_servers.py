"""The trainer's side: :class:`VLLMServers`, an asyncio client of vLLM's weight-transfer routes.

``async with servers.attach(scheme)`` makes every server's workers receivers of ``scheme`` and
adds a second step to each of its sends: once every worker holds the version (transferred while
the servers kept generating), each server is paused, loads the version from its workers' copy,
takes ``str(version)`` as its ``weight_version`` and resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import httpx

from .._scheme.scheme import WeightSyncScheme
from .._scheme.sender import SenderSession
from .._util.shield import to_the_end
from ._describe import describe
from ._http import KEEPALIVE_S, VLLMServerError, VLLMServerTimeout, first_error, request
from ._steps import Server, Steps, may_hold

__all__ = ["PauseMode", "VLLMServerError", "VLLMServerTimeout", "VLLMServers"]

PauseMode = Literal["wait", "keep", "abort"]

log = logging.getLogger("aiowsync.vllm")


class VLLMServers:
    """vLLM servers (``--weight-transfer-config '{"backend": "aiowsync"}'``) that take their
    weights from an aiowsync scheme.

    Args:
        urls: each server's base URL (``http://host:port``).
        pause: how a server treats the requests in flight while it loads a version:
            ``"wait"`` lets them finish on the old version first, ``"keep"`` freezes them and
            continues them on the new one (their ``weight_versions`` spans say where the version
            changed), ``"abort"`` ends them.
        together: with several servers, load the version on every server before any of them
            resumes (and take it back on all of them if one fails), so that no two servers
            generate with different versions; each server then stays paused until the slowest
            has loaded it.
        timeout: the limit of one HTTP call (loading a version included); attaching also allows
            for the scheme's handshake timeout.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        pause: PauseMode = "wait",
        together: bool = False,
        timeout: float = 120.0,
    ) -> None:
        if isinstance(urls, str):
            raise TypeError("urls is a sequence of URLs; wrap a single one in a list")
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("give at least one server URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server is named twice: {urls}")
        if pause not in ("wait", "keep", "abort"):
            raise ValueError(f"pause must be 'wait', 'keep' or 'abort', got {pause!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.urls: tuple[str, ...] = tuple(urls)
        self.pause: PauseMode = pause
        self.together = together
        self.timeout = timeout
        self._servers: list[Server] = []
        self._steps = Steps(timeout)
        self.pause_seconds: dict[str, float] = self._steps.pause_seconds
        """Per server, how long its last version change kept it from generating (the pause
        call until the resume call returned)."""

    # -- attaching ----------------------------------------------------------------------------

    @asynccontextmanager
    async def attach(self, scheme: WeightSyncScheme) -> AsyncIterator[VLLMServers]:
        """Make the servers' workers receivers ``0 .. N-1`` of ``scheme`` (entered, not yet
        connected) for the duration of the block; every ``scheme.send()`` (and
        ``scheme.connect()``) returns once every server generates with the version.

        Raises:
            ValueError: the servers' workers do not number ``scheme``'s ``num_workers``.
            VLLMServerError: a server refused (the error it gave included).
            RuntimeError: ``scheme`` is not an entered sender, or servers are attached already.
        """
        sending = scheme._sending
        if not isinstance(sending, SenderSession) or not sending.entered:
            raise RuntimeError(
                "attach a sender's scheme inside `async with scheme:` "
                "(init_on_sender, then `async with scheme, servers.attach(scheme):`)"
            )
        if sending.models is not None:
            raise ValueError(
                "a vLLM server takes one model: init_on_sender(model=...), not models="
            )
        if self._steps.client is not None:
            raise RuntimeError("these servers are attached to a scheme already")
        description = describe(scheme)
        limit = self.timeout + scheme.timeouts.handshake
        # vLLM's uvicorn closes a connection idle for 5 s: a call sent on one as it closes
        # fails, so idle connections are let go sooner (a call between sends finds a fresh one).
        self._steps.client = httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
        try:
            self._servers = await self._number(sending.num_workers)
            try:
                await first_error(self._init(s, description, limit) for s in self._servers)
                sending.finishers.append(self)
                try:
                    yield self
                finally:
                    sending.finishers.remove(self)
            finally:
                # The servers' workers let this trainer go (those that joined, when one could
                # not); the servers keep what they loaded. Even when the block was cancelled.
                await to_the_end(self._detach(self._servers))
        finally:
            client, self._steps.client = self._steps.client, None
            await to_the_end(client.aclose())

    async def _detach(self, servers: list[Server]) -> None:
        results = await asyncio.gather(
            *(self._steps.call(s, "shutdown_weight_transfer_engine", always=True) for s in servers),
            return_exceptions=True,
        )
        for server, result in zip(servers, results, strict=True):
            if isinstance(result, Exception):
                log.warning("%s: could not detach it from this trainer: %s", server.url, result)

    async def _number(self, num_workers: int) -> list[Server]:
        sizes = await asyncio.gather(*(self._world_size(url) for url in self.urls))
        if sum(sizes) != num_workers:
            each = ", ".join(f"{url}: {n}" for url, n in zip(self.urls, sizes, strict=True))
            raise ValueError(
                f"the servers have {sum(sizes)} workers in all ({each}) but the scheme was made "
                f"for num_workers={num_workers}: give init_on_sender num_workers={sum(sizes)}"
            )
        servers, first = [], 0
        for url, size in zip(self.urls, sizes, strict=True):
            servers.append(Server(url, first, size))
            first += size
        return servers

    async def _world_size(self, url: str) -> int:
        reply = await self._steps.request("GET", url, "get_world_size")
        size = reply.get("world_size")
        if not isinstance(size, int) or size < 1:
            raise VLLMServerError(url, "get_world_size", f"unexpected answer {reply!r}")
        return size

    async def _init(self, server: Server, description: dict[str, Any], limit: float) -> None:
        info = {"scheme": description, "first_worker": server.first, "server_url": server.url}
        await self._steps.call(
            server, "init_weight_transfer_engine", {"init_info": info}, limit=limit
        )
        server.version = None

    # -- the second step of a send ------------------------------------------------------------

    def check(self, worker_ids: Sequence[int]) -> None:
        targets = set(worker_ids)
        for server in self._servers:
            some = targets.intersection(server.workers)
            if some and len(some) != server.size:
                raise ValueError(
                    f"a send reaches all of a vLLM server's workers or none: {server.url} has "
                    f"workers {list(server.workers)}, the send names {sorted(some)}"
                )

    async def finish(self, version: int, worker_ids: Sequence[int], deadline: float | None) -> None:
        self._steps.deadline = deadline
        try:
            await self._finish(version, worker_ids)
        finally:
            self._steps.deadline = None

    async def _finish(self, version: int, worker_ids: Sequence[int]) -> None:
        targets = set(worker_ids)
        servers = [s for s in self._servers if targets.issuperset(s.workers)]
        if not servers:
            return
        if self.together and len(servers) > 1:
            await self._switch_together(servers, version)
        else:
            await first_error(self._switch(s, version) for s in servers)

    async def _switch(self, server: Server, version: int) -> None:
        """Pause, load ``version``, label it, resume. Whatever fails, and also when the send
        is cancelled, the server is resumed with the version it served (see
        :meth:`Steps.take_back`)."""
        started = time.perf_counter()
        step, failed = "pause", False
        try:
            # In the block: a pause that fails or times out may still happen on the server.
            await self._steps.call(server, "pause", params={"mode": self.pause})
            step = "load"
            await self._steps.load(server, version)
            step = "label"
            await self._steps.label(server, version)
        except BaseException as exc:
            failed = True
            if may_hold(step, exc, server.size):
                await to_the_end(self._steps.take_back_quietly(server))
            raise
        finally:
            await to_the_end(self._steps.resume(server, started, quiet=failed))

    async def _switch_together(self, servers: list[Server], version: int) -> None:
        """Every server loads ``version`` before any resumes; if one cannot, the others take
        their previous version back."""
        started, failed = time.perf_counter(), False
        try:
            await first_error(
                self._steps.call(s, "pause", params={"mode": self.pause}) for s in servers
            )
            try:
                loads = await asyncio.gather(
                    *(self._steps.load(s, version) for s in servers), return_exceptions=True
                )
            except BaseException:  # cancelled: every server may hold the version
                await to_the_end(self._steps.take_back_all(servers))
                raise
            errors = [e for e in loads if isinstance(e, BaseException)]
            if errors:
                await to_the_end(
                    self._steps.take_back_all(
                        s
                        for s, e in zip(servers, loads, strict=True)
                        if may_hold("load", e, s.size)
                    )
                )
                raise errors[0]
            # Every server holds the version: its label goes on past the deadline (it takes
            # milliseconds), since a server left out would split the fleet.
            labels = await to_the_end(
                asyncio.gather(
                    *(self._steps.label(s, version, always=True) for s in servers),
                    return_exceptions=True,
                )
            )
            unlabelled = [s for s, e in zip(servers, labels, strict=True) if e is not None]
            if unlabelled:
                await to_the_end(self._steps.take_back_all(unlabelled))
                raise next(e for e in labels if e is not None)
        except BaseException:
            failed = True
            raise
        finally:
            await to_the_end(
                first_error(self._steps.resume(s, started, quiet=failed) for s in servers)
            )

    # -- reading the servers ------------------------------------------------------------------

    async def weight_versions(self) -> dict[str, str | None]:
        """Each server's ``weight_version`` (``str(version)`` once attached and sent; None
        where the server has none). Attached or not."""
        own = self._steps.client is None
        client = httpx.AsyncClient() if self._steps.client is None else self._steps.client
        try:
            replies = await asyncio.gather(
                *(
                    request(client, "GET", url, "weight_info", limit=self.timeout)
                    for url in self.urls
                )
            )
        finally:
            if own:
                await to_the_end(client.aclose())
        labels = [r.get("weight_version") for r in replies]
        return {
            url: None if label is None else str(label)
            for url, label in zip(self.urls, labels, strict=True)
        }
