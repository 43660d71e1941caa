"""A receiver's view of its connection to the sender, and the thread that beats for it.

libzmq reports a socket's connections through a monitor socket that must be read all the
time, not only when the event loop asks: libzmq's I/O thread blocks, holding a lock that
closing the socket needs, once a few thousand events are unread, and a receiver that outlives
its sender queues one per reconnection attempt. One thread therefore reads the monitor on a
period from the channel's creation to its close, and sends the heartbeats once asked to; the
event loop reads the monitor too, one reader at a time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from .._protocol import Heartbeat, encode

__all__ = ["ConnectionWatch"]

log = logging.getLogger("aiowsync.channel")

_MONITOR_PERIOD = 1.0
"""Seconds between two reads of the monitor by the thread, at most: libzmq queues an event
per reconnection attempt (ten a second) and stalls once a few thousand are unread."""

_JOIN_WAIT = 5.0
"""Seconds ``close()`` waits for the thread, which wakes at once when told to stop."""

_DOWN_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class ConnectionWatch:
    """Whether ``sock`` reached its peer, how often it did, and its heartbeats.

    The peer counts as reached once the ZMTP handshake (and the CURVE check) passed. Beats go
    out on a socket of their own, made by ``beat_socket`` in the thread, since zmq sockets are
    not thread-safe and the event loop may be busy. A failure to beat is logged and ends the
    beats, never the monitor's reading.
    """

    def __init__(
        self, sock: zmq.Socket[bytes], beat_socket: Callable[[], zmq.Socket[bytes]]
    ) -> None:
        self._sock = sock
        self._beat_socket = beat_socket
        # Held here: were it referenced by ``sock`` alone, disable_monitor() would drop it
        # unclosed (a ResourceWarning, and a second close of the same handle).
        self._monitor: zmq.Socket[bytes] = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | _DOWN_EVENTS
        )
        self._lock = threading.Lock()
        self._alive = False
        self._connections = 0
        self._changed_at: float | None = None
        self._beat: tuple[Callable[[], Heartbeat], float] | None = None
        self._stop = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; call it once ``sock`` connects, which starts queueing events."""
        self._thread = threading.Thread(target=self._run, name="aiowsync-heartbeat", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the latest connection event says the peer is reached."""
        self.read()
        return self._alive

    @property
    def connections(self) -> int:
        """How many times the connection to the peer came up so far."""
        self.read()
        return self._connections

    @property
    def changed_at(self) -> float | None:
        """When (``time.monotonic()``) the latest connection event was taken in: the time the
        connection has been in its present state since, to within the thread's period (None
        before any event). Read :attr:`alive` first: this takes in no events of its own."""
        return self._changed_at

    def read(self) -> None:
        with self._lock:
            self._drain()

    def _drain(self) -> None:
        """Take in every queued event; the caller holds ``_lock``."""
        while not self._monitor.closed:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.Again, zmq.ZMQError):
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._alive = True
                self._connections += 1
                self._changed_at = time.monotonic()
            elif event["event"] & _DOWN_EVENTS:
                if self._alive or self._changed_at is None:
                    self._changed_at = time.monotonic()  # down since the first such event
                self._alive = False

    def start_heartbeat(self, beat: Callable[[], Heartbeat], interval: float) -> None:
        if self._beat is not None:
            raise RuntimeError("heartbeat already running")
        self._beat = (beat, interval)
        self._wake.set()

    def stop_heartbeat(self) -> None:
        self._beat = None  # read by the thread before each beat
        self._wake.set()

    def close(self) -> bool:
        """Stop the thread and the monitor; ``sock`` itself stays open. False when the thread
        did not end in time (it is stuck in a beat): its socket is still open then."""
        self._stop = True
        self._wake.set()
        ended = True
        if self._thread is not None:
            self._thread.join(timeout=_JOIN_WAIT)
            ended = not self._thread.is_alive()
        with self._lock:
            # Read what is queued first: libzmq's thread may be waiting for room to queue one
            # more event, holding the lock that disable_monitor() takes.
            self._drain()
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        return ended

    def _run(self) -> None:
        sock: zmq.Socket[bytes] | None = None
        next_beat = 0.0
        try:
            while not self._stop:
                self.read()
                wait = _MONITOR_PERIOD
                beating = self._beat  # once: stop_heartbeat() may clear it meanwhile
                if beating is not None:
                    beat, interval = beating
                    now = time.monotonic()
                    try:
                        if now >= next_beat:
                            if sock is None:
                                sock = self._beat_socket()
                            with contextlib.suppress(zmq.Again):
                                # Sender unreachable right now: the next beat tries again.
                                sock.send(encode(beat()), zmq.NOBLOCK)
                            next_beat = now + interval
                        wait = min(wait, max(0.0, next_beat - time.monotonic()))
                    except Exception as exc:
                        if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.ETERM:
                            return
                        log.warning("heartbeats stopped: %s", exc)
                        self._beat = None
                self._wake.wait(wait)
                self._wake.clear()
        finally:
            if sock is not None:
                sock.close(linger=0)
