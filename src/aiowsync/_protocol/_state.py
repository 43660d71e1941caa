"""Per-role connection state machines, with no I/O.

One :class:`Connection` tracks one sender<->receiver pair from one side: the sender keeps one per
worker, a receiver keeps exactly one. Both sides use the same table.

Rules (``TRANSITIONS`` is the single source of truth):

* A receiver opens with ``Hello``; the sender answers ``Welcome`` or ``Refuse``.
* After ``Welcome`` the receiver applies the initial version and answers ``Ack`` (or ``Nack``);
  the first ``Ack`` makes the pair ``LIVE``.
* The sender may send ``Update`` once it has welcomed the receiver; each ``Update`` carries a
  version strictly greater than the previous one, or the same version with a higher ``attempt``
  (a retry after a failed transfer) while that version is still unacknowledged. Several may be
  outstanding (a cancelled send leaves one behind), so ``Ack``/``Nack`` name the version they
  answer, which must be one the sender actually sent.
* ``Heartbeat`` is allowed in every open state; ``Bye`` from either side closes the pair.
* Anything not in the table is a protocol error and moves the machine to ``ERROR``, where only
  ``Bye`` is accepted.
"""

from __future__ import annotations

import enum
from typing import Final, NoReturn

from .._exceptions import ProtocolError
from ._messages import Ack, Bye, Heartbeat, Hello, Message, Nack, Refuse, Update, Welcome

__all__ = ["Connection", "Role", "State", "TRANSITIONS"]


class Role(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


class State(enum.Enum):
    START = "start"  # nothing exchanged yet
    HELLO = "hello"  # Hello sent (receiver) / received (sender)
    SYNCING = "syncing"  # welcomed, initial version not yet acknowledged
    LIVE = "live"  # initial version acknowledged
    CLOSED = "closed"
    ERROR = "error"


_FROM_RECEIVER: Final = frozenset({Hello, Ack, Nack})
_FROM_SENDER: Final = frozenset({Welcome, Refuse, Update})
_NAMED: Final = (Hello, Ack, Nack)
_ANSWERS: Final = (Ack, Nack)

_Table = dict[tuple[Role, State], dict[type[Message], State]]

_S, _R = Role.SENDER, Role.RECEIVER
_OPEN_TAIL: Final[dict[type[Message], State]] = {Heartbeat: State.LIVE, Bye: State.CLOSED}

TRANSITIONS: Final[_Table] = {
    (_S, State.START): {Hello: State.HELLO, Bye: State.CLOSED},
    (_S, State.HELLO): {
        Welcome: State.SYNCING,
        Refuse: State.CLOSED,
        Heartbeat: State.HELLO,
        Bye: State.CLOSED,
    },
    (_S, State.SYNCING): {
        Ack: State.LIVE,
        Nack: State.SYNCING,
        Update: State.SYNCING,
        Heartbeat: State.SYNCING,
        Bye: State.CLOSED,
    },
    (_S, State.LIVE): {Update: State.LIVE, Ack: State.LIVE, Nack: State.LIVE, **_OPEN_TAIL},
    (_S, State.CLOSED): {Bye: State.CLOSED, Heartbeat: State.CLOSED},
    (_S, State.ERROR): {Bye: State.CLOSED},
    (_R, State.START): {Hello: State.HELLO, Bye: State.CLOSED},
    (_R, State.HELLO): {
        Welcome: State.SYNCING,
        Refuse: State.CLOSED,
        Heartbeat: State.HELLO,
        Bye: State.CLOSED,
    },
    (_R, State.SYNCING): {
        Ack: State.LIVE,
        Nack: State.SYNCING,
        Update: State.SYNCING,
        Heartbeat: State.SYNCING,
        Bye: State.CLOSED,
    },
    (_R, State.LIVE): {Update: State.LIVE, Ack: State.LIVE, Nack: State.LIVE, **_OPEN_TAIL},
    (_R, State.CLOSED): {Bye: State.CLOSED, Heartbeat: State.CLOSED},
    (_R, State.ERROR): {Bye: State.CLOSED},
}


class Connection:
    """The protocol state of one sender<->receiver pair, seen from ``role``.

    Call :meth:`send` before putting a message on the wire and :meth:`receive` for each message
    taken off it. Both raise :class:`ProtocolError` for a message the protocol does not allow,
    after moving the machine to ``State.ERROR``.
    """

    __slots__ = (
        "_acked",
        "_allowed",
        "_allowed_in",
        "_attempt",
        "_error",
        "_outstanding",
        "_sent_versions",
        "role",
        "state",
        "worker_idx",
    )

    def __init__(self, role: Role, worker_idx: int | None = None) -> None:
        self.role = role
        self.state = State.START
        self.worker_idx = worker_idx
        self._sent_versions: int = -1  # highest Update/Welcome version on this pair
        self._acked: int = -1  # highest version acknowledged
        self._attempt: int = 0  # attempt number of the latest announced version
        # Versions announced on this pair that an answer may still name. Versions on one pair
        # can skip (updates sent to a subset of workers), so "<= latest" is not enough.
        self._outstanding: set[int] = set()
        self._error: str | None = None
        # The row of TRANSITIONS for the state it was looked up in (enum hashing is slow).
        self._allowed_in: State | None = None
        self._allowed: dict[type[Message], State] = {}

    @property
    def latest_update(self) -> int:
        """Highest version announced on this pair (-1 before ``Welcome``)."""
        return self._sent_versions

    @property
    def acked_version(self) -> int:
        """Highest version the receiver acknowledged (-1 before the first ``Ack``)."""
        return self._acked

    @property
    def error(self) -> str | None:
        return self._error

    def send(self, message: Message) -> None:
        self._step(message, outgoing=True)

    def receive(self, message: Message) -> None:
        self._step(message, outgoing=False)

    def _step(self, message: Message, *, outgoing: bool) -> None:
        kind = type(message)
        if kind in _FROM_RECEIVER or kind in _FROM_SENDER:
            by_receiver = kind in _FROM_RECEIVER
            sent_by_me = outgoing
            is_receiver = self.role is Role.RECEIVER
            if by_receiver != (sent_by_me == is_receiver):
                self._fail(f"{kind.__name__} cannot travel that way for a {self.role.value}")
        if self._allowed_in is not self.state:
            self._allowed_in = self.state
            self._allowed = TRANSITIONS[(self.role, self.state)]
        next_state = self._allowed.get(kind)
        if next_state is None:
            self._fail(f"{kind.__name__} is not allowed in state {self.state.value}")
        self._check_fields(message)
        if kind is Heartbeat:
            return  # heartbeats never change the state
        self.state = next_state

    def _check_fields(self, message: Message) -> None:
        named = isinstance(message, _NAMED) and self.worker_idx is not None
        if named and message.worker_idx != self.worker_idx:  # type: ignore[union-attr]
            self._fail(f"message names worker {message.worker_idx}, expected {self.worker_idx}")  # type: ignore[union-attr]
        if isinstance(message, Hello) and self.worker_idx is None:
            self.worker_idx = message.worker_idx
        if isinstance(message, Welcome):
            self._sent_versions = message.version
            self._attempt = 0
            self._outstanding.add(message.version)
        elif isinstance(message, Update):
            retry = message.version == self._sent_versions and message.attempt > self._attempt
            if retry and message.version <= self._acked:
                self._fail(f"retry of version {message.version}, which was already acknowledged")
            if message.version <= self._sent_versions and not retry:
                self._fail(
                    f"update to version {message.version} (attempt {message.attempt}) does not "
                    f"follow {self._sent_versions} (attempt {self._attempt})"
                )
            self._sent_versions = message.version
            self._attempt = message.attempt
            self._outstanding.add(message.version)
        elif isinstance(message, _ANSWERS):
            if message.version not in self._outstanding:
                self._fail(f"answer for version {message.version}, which was never sent")
            # Answers arrive in order, so nothing older than an answer can be answered later
            # (a nacked version may be sent again, and answered again).
            if isinstance(message, Ack):
                self._acked = max(self._acked, message.version)
            self._outstanding = {v for v in self._outstanding if v >= message.version}

    def _fail(self, reason: str) -> NoReturn:
        self.state = State.ERROR
        self._error = reason
        raise ProtocolError(reason)
