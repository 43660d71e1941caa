"""A blocking face for synchronous code: the scheme runs on a private event loop in a thread.

Most trainers are plain loops. :func:`blocking` starts an event loop in a background thread,
enters the scheme there (``async with scheme``, held by one task for the scheme's whole life,
since a task group must be left by the task that entered it) and turns each call into a
coroutine submitted to that loop, whose result or exception comes back unchanged. A receiver's
background task keeps applying versions on that loop while the calling thread runs its own
loop under the scheme's read guard.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from .._receiving.guard import ReadGuard
from .._receiving.lease import Lease
from .._sending.outcome import SendResult
from .._sending.workers import WorkerTable
from .._weights.flatten import WeightsLike
from .scheme import WeightSyncScheme

__all__ = ["BlockingScheme", "blocking"]

T = TypeVar("T")

log = logging.getLogger("aiowsync")

START_WAIT_S = 60.0
"""How long entering waits for the loop thread to start and the scheme to enter (binding a
socket, creating slot files: milliseconds)."""
STOP_WAIT_S = 30.0
"""How long leaving waits for the scheme to leave ``async with`` (its own waits are shorter)
and then for calls still running to end."""
POLL_S = 0.5
"""How often a blocked caller checks that the loop thread is still alive."""


def blocking(scheme: WeightSyncScheme) -> BlockingScheme:
    """``with aiowsync.blocking(scheme) as s:``: the scheme's API as blocking calls.

    ``scheme`` must have been initialised (``init_on_sender`` or ``init_on_receiver``) and
    not be entered: the context manager enters it on its own loop and leaves it on exit, also
    when the body raises (``KeyboardInterrupt`` included).
    """
    return BlockingScheme(scheme, _made=_BY_BLOCKING)


_BY_BLOCKING = object()
"""Proof that :func:`blocking` made the object: it is the one way to a :class:`BlockingScheme`."""


class BlockingScheme:
    """A scheme driven from synchronous code (see :func:`blocking`).

    Every method has the name, arguments, result and exceptions of the scheme's coroutine of
    the same name. Calls made from inside a running event loop, or after the ``with`` block
    ended, raise :class:`RuntimeError` instead of blocking. Made by :func:`blocking` only;
    the class is public for type annotations.
    """

    def __init__(self, scheme: WeightSyncScheme, *, _made: object = None) -> None:
        if _made is not _BY_BLOCKING:
            raise TypeError(
                "use aiowsync.blocking(scheme): BlockingScheme is the type it returns, not a "
                "second way to build one"
            )
        self.scheme = scheme
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._host: concurrent.futures.Future[None] | None = None
        self._calls: set[concurrent.futures.Future[Any]] = set()
        self._calls_lock = threading.Lock()  # the loop thread discards, the caller adds
        self._closed = False

    # -- life cycle -------------------------------------------------------------------------

    def __enter__(self) -> BlockingScheme:
        if self._loop is not None or self._closed:
            raise RuntimeError("a blocking scheme is entered once")
        _refuse_inside_a_loop()
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name="aiowsync-blocking", daemon=True
        )
        self._thread.start()
        entered: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._host = asyncio.run_coroutine_threadsafe(self._hold(entered), loop)
        try:
            entered.result(START_WAIT_S)
        except BaseException:
            # Entering failed, timed out or was interrupted: unwind what it entered.
            self._host.cancel()
            concurrent.futures.wait([self._host], STOP_WAIT_S)
            self._shut_loop()
            raise
        _OPEN.add(self)  # closed at interpreter exit if nobody closes it before
        return self

    async def _hold(self, entered: concurrent.futures.Future[None]) -> None:
        """The task that holds ``async with scheme`` open until :meth:`close`."""
        self._stop = asyncio.Event()
        try:
            async with self.scheme:
                entered.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not entered.done():
                entered.set_exception(exc)
            raise

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            self.close()
        except Exception:
            if exc is None:
                raise
            # The body's own exception is the one to see.
            log.warning("leaving the scheme after an error failed too", exc_info=True)

    def close(self) -> None:
        """Leave the scheme and stop the loop thread; idempotent. Calls still running get the
        scheme's shutdown errors; any left after :data:`STOP_WAIT_S` are cancelled, and the
        loop runs until they have unwound."""
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("close() from the scheme's own loop thread would wait on itself")
        self._closed = True
        loop, host = self._loop, self._host
        if loop is None or host is None:
            return
        error: BaseException | None = None
        try:
            if self._stop is not None:
                loop.call_soon_threadsafe(self._stop.set)
            if not concurrent.futures.wait([host], STOP_WAIT_S).done:
                log.warning("the scheme did not leave `async with` within %g s", STOP_WAIT_S)
            elif not host.cancelled():
                error = host.exception()  # the scheme's own error on leaving, if any
            with self._calls_lock:
                pending = [f for f in self._calls if not f.done()]
            concurrent.futures.wait(pending, STOP_WAIT_S)
        finally:
            self._shut_loop()
        if error is not None:
            raise error

    def _shut_loop(self) -> None:
        """Cancel what still runs on the loop and let it unwind, as ``asyncio.run`` does at
        its end; then stop the loop and its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._closed = True
        if thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_unwind(), loop).result(STOP_WAIT_S)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(STOP_WAIT_S)
        if not thread.is_alive():
            loop.close()

    # -- calls --------------------------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed or self._loop is None:
            coro.close()
            raise RuntimeError(
                "this blocking scheme is closed (or was never entered): use it inside "
                "`with aiowsync.blocking(scheme) as s:`"
            )
        try:
            _refuse_inside_a_loop()
        except RuntimeError:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        with self._calls_lock:
            self._calls.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._calls_lock:
            self._calls.discard(future)

    def _wait(self, future: concurrent.futures.Future[T]) -> T:
        # Every call has its own deadline inside the scheme; this only makes sure a dead loop
        # thread cannot leave the caller blocked.
        # (Not future.result(POLL_S): its TimeoutError is the scheme's WeightSyncTimeout too.)
        while not concurrent.futures.wait([future], POLL_S).done:
            if self._thread is None or not self._thread.is_alive():
                future.cancel()
                raise RuntimeError("the blocking scheme's loop thread ended")
        return future.result()

    def connect(self, timeout: float | None = None) -> None:
        """See :meth:`WeightSyncScheme.connect`."""
        return self._wait(self._submit(self.scheme.connect(timeout)))

    def send(
        self,
        weights: WeightsLike | str | None = None,
        worker_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> SendResult:
        """See :meth:`WeightSyncScheme.send`. The weights must not change before it returns."""
        return self._wait(self.send_soon(weights, worker_ids, timeout))

    def send_soon(
        self,
        weights: WeightsLike | str | None = None,
        worker_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[SendResult]:
        """Start a send and return at once: a future of its :class:`SendResult` (or its
        error). Sends are staged in call order. The weights must not change before the future
        is done."""
        return self._submit(self.scheme.send(weights, worker_ids, timeout))

    def publish(
        self,
        weights: WeightsLike | str | None = None,
        worker_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[SendResult]:
        """Two-phase send (see :meth:`WeightSyncScheme.publish`): blocks until the version is
        staged, after which the weights may change, and returns a future of its
        :class:`SendResult` (or its error)."""
        pending = self._wait(self._submit(self.scheme.publish(weights, worker_ids, timeout)))
        return self._submit(pending.wait())

    @property
    def workers(self) -> WorkerTable:
        """See :attr:`WeightSyncScheme.workers`."""
        return self.scheme.workers

    def receive(self, timeout: float | None = None) -> int | None:
        """See :meth:`WeightSyncScheme.receive`."""
        return self._wait(self._submit(self.scheme.receive(timeout)))

    def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """See :meth:`WeightSyncScheme.wait_for_version`."""
        return self._wait(self._submit(self.scheme.wait_for_version(version, timeout)))

    def read_guard(self) -> ReadGuard:
        """The scheme's read guard; hold it with ``with`` around each forward."""
        return self.scheme.read_guard()

    def lease(self) -> Lease:
        """A lease (see :meth:`WeightSyncScheme.lease`); hold it with ``with``."""
        return self.scheme.lease()

    @property
    def version(self) -> int:
        """See :attr:`WeightSyncScheme.version`."""
        return self.scheme.version

    @property
    def generation(self) -> int:
        """See :attr:`WeightSyncScheme.generation`."""
        return self.scheme.generation

    @property
    def ready(self) -> bool:
        """See :attr:`WeightSyncScheme.ready`."""
        return self.scheme.ready

    @property
    def connected(self) -> bool:
        """See :attr:`WeightSyncScheme.connected`."""
        return self.scheme.connected


async def _unwind() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


_OPEN: weakref.WeakSet[BlockingScheme] = weakref.WeakSet()
"""Blocking schemes entered and not closed yet."""


@atexit.register
def _close_at_exit() -> None:
    """Leave every blocking scheme still open while its loop thread runs (a daemon thread,
    which the interpreter would stop mid-way): a sender's slot files and socket directory go
    with it, as they do when it is closed."""
    for facade in list(_OPEN):
        try:
            facade.close()
        except Exception as exc:
            log.warning("at exit, leaving a blocking scheme failed: %s", exc)


def _refuse_inside_a_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        "aiowsync.blocking() calls block, and this thread runs an event loop: await the "
        "scheme's own coroutines here instead"
    )
