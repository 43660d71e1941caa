"""Named deadlines and liveness settings (frozen, validated on construction).

May import: aiowsync._exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Heartbeats", "Timeouts"]


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines, in seconds, for each phase of the protocol.

    Attributes:
        handshake: ``connect()`` given no timeout, on either side: a receiver's whole connect
            (hello, welcome and applying the current version), the sender's wait until every
            worker holds version 0; also how long the sender helps a joining worker catch up.
        ack: a ``send()`` waits this long for the targeted workers' acks when given no timeout;
            also the default of ``wait_for_version()`` and ``receive()``, and on a receiver
            the longest a switch waits for readers to leave the read guard and the longest its
            hooks may run.
        transfer: staging a version (the bulk copy or the collective) must finish within this.
        control: one control message must find room to be sent within this.
    """

    handshake: float = 60.0
    ack: float = 30.0
    transfer: float = 120.0
    control: float = 5.0

    def __post_init__(self) -> None:
        for name in ("handshake", "ack", "transfer", "control"):
            _positive(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class Heartbeats:
    """Liveness: a peer is lost after ``missed`` beats of ``interval`` seconds went unheard.

    The default declares a peer lost after 1.5 s of silence. Beats are sent from a thread, so a
    receiver whose event loop is busy with the user's own work keeps beating.
    """

    interval: float = 0.5
    missed: int = 3

    def __post_init__(self) -> None:
        _positive("interval", self.interval)
        if not 0.01 <= self.interval <= 3600:
            raise ValueError(f"interval must be 0.01 s to an hour, got {self.interval!r}")
        if not isinstance(self.missed, int) or self.missed < 1:
            raise ValueError(f"missed must be a positive integer, got {self.missed!r}")

    @property
    def timeout(self) -> float:
        """Seconds of silence after which a peer is declared lost."""
        return self.interval * self.missed
