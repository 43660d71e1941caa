"""The trainer's HTTP calls to vLLM servers, and the errors they raise."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import httpx

from .._exceptions import WeightSyncError, WeightSyncTimeout

__all__ = ["KEEPALIVE_S", "VLLMServerError", "VLLMServerTimeout", "first_error", "request"]

KEEPALIVE_S = 2.0
"""How long an idle connection to a server is kept: below uvicorn's 5 s (vLLM's
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` default), so that a call never goes out on a connection the
server is closing."""
CONNECT_S = 10.0
"""The most a connection to a server may take, within a call's own limit."""


class VLLMServerError(WeightSyncError):
    """A vLLM server refused or failed a step of attaching or of a send.

    Attributes:
        url: the server.
        step: the route that failed (``"update_weights"``, ...).
        detail: what the server (or the connection) said.
        status: the HTTP status the server answered with; None when no answer came (the
            connection failed, or the call ran past its limit), so the server may have
            carried the call out all the same.
    """

    def __init__(self, url: str, step: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"vLLM server {url}: {step} failed: {detail}")
        self.url = url
        self.step = step
        self.detail = detail
        self.status = status


class VLLMServerTimeout(VLLMServerError, WeightSyncTimeout):
    """A server's step of a send did not finish by the send's deadline (the server was
    resumed, with the version it served before unless its label had moved)."""


async def request(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    route: str,
    body: dict[str, Any] | None = None,
    *,
    params: dict[str, str] | None = None,
    limit: float,
) -> dict[str, Any]:
    """Call ``route`` of the server at ``url`` within ``limit`` seconds; its JSON answer (an
    empty dict when it is not a JSON object), or :class:`VLLMServerError`."""
    timeout = httpx.Timeout(limit, connect=min(limit, CONNECT_S))
    reply = None
    # httpx bounds each phase of a call (connecting, then reading) by its timeout, and the
    # call may be made twice: the whole is bounded by ``limit`` here.
    with anyio.move_on_after(limit):
        for attempt in (1, 2):
            try:
                reply = await client.request(
                    method, f"{url}/{route}", json=body, params=params, timeout=timeout
                )
                break
            except httpx.TransportError as exc:
                # A server that failed the call before closes its connection after its
                # answer; the next call on that connection meets the close: try once more on
                # a fresh one (every call here may be made twice).
                if attempt == 2 or isinstance(exc, httpx.TimeoutException):
                    raise VLLMServerError(url, route, f"{type(exc).__name__}: {exc}") from exc
            except httpx.HTTPError as exc:
                raise VLLMServerError(url, route, f"{type(exc).__name__}: {exc}") from exc
    if reply is None:
        raise VLLMServerError(url, route, f"no answer within {limit:g} s")
    if reply.status_code >= 400:
        raise VLLMServerError(
            url, route, f"HTTP {reply.status_code}: {_detail(reply)}", reply.status_code
        )
    try:
        answer = reply.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _detail(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:2000]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:2000]
    return str(body)[:2000]


async def first_error(steps: Any) -> None:
    """Run ``steps`` together, let each finish, raise the first error."""
    outcomes = await asyncio.gather(*steps, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
