"""CURVE keys for the ZeroMQ control channel, and the ZAP handlers that check who connects.

A sender holds the server key pair and the set of client public keys it accepts; each receiver
holds the server public key and one client key pair. A tcp sender always has keys (its
factory makes them when none are given); a sender without keys on a Unix socket checks
instead that each connecting process runs as its own user. See docs/security.md.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

from .._exceptions import TransportError
from .._util.text import worth_logging

__all__ = ["CurveKeys"]

log = logging.getLogger("aiowsync.auth")

_KEY_CHARS = frozenset(z85.Z85CHARS)
_ZAP_DOMAIN = "aiowsync"
_STOP_WAIT = 5.0
"""Seconds ``close()`` waits for the ZAP thread, which stops as soon as it reads the request."""


def _z85_key(name: str, value: object) -> str:
    """``value`` as a 40-character z85 key string; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError(f"{name} must be a z85-encoded CURVE key (ASCII)") from None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a z85-encoded key as str or bytes, got {value!r}")
    if len(value) != 40:
        raise ValueError(f"{name} must be 40 z85 characters (a 32-byte key), got {len(value)}")
    raw = value.encode("utf-8")
    if not value.isascii() or not set(raw) <= _KEY_CHARS:
        raise ValueError(f"{name} contains characters outside the z85 alphabet")
    try:
        canonical = z85.encode(z85.decode(raw)) == raw
    except (ValueError, struct.error):
        canonical = False
    if not canonical:
        raise ValueError(f"{name} is not a valid z85 encoding of a 32-byte key")
    return value


def _check_pair(kind: str, public: str, secret: str) -> None:
    try:
        derived = zmq.curve_public(secret.encode("ascii")).decode("ascii")
    except zmq.ZMQError as exc:
        raise ValueError(f"{kind}_secret is not a usable CURVE secret key: {exc}") from None
    if derived != public:
        raise ValueError(f"{kind}_secret does not belong to {kind}_public")


class CurveKeys:
    """CURVE key material for :class:`ZmqChannelFactory` (all keys are z85 strings). A factory
    given none makes keys of its own for its tcp binds, as :meth:`generate` does.

    The sender needs ``server_secret`` and ``allowed_clients``; a receiver needs
    ``server_public`` and one client key pair (``client_public``, ``client_secret``).
    ``allowed_clients`` always contains ``client_public`` when one is given, so keys made by
    :meth:`generate` let every worker that holds them in.

    **Pickling drops the server secret**: a scheme or factory pickled for a worker carries only
    what a receiver needs. Copies made with :mod:`copy` keep it.

    Args:
        server_public: the sender's public key.
        server_secret: the sender's secret key; only the sender should hold it.
        client_public: the public key this process's receivers present.
        client_secret: the matching secret key.
        allowed_clients: further client public keys the sender accepts (e.g. one per worker).

    Raises:
        ValueError: a key is not 40 z85 characters, a secret does not match its public key, or
            a client key is given without its other half.
    """

    __slots__ = (
        "allowed_clients",
        "client_public",
        "client_secret",
        "server_public",
        "server_secret",
    )

    server_public: str
    server_secret: str | None
    client_public: str | None
    client_secret: str | None
    allowed_clients: frozenset[str]

    def __init__(
        self,
        *,
        server_public: str | bytes,
        server_secret: str | bytes | None = None,
        client_public: str | bytes | None = None,
        client_secret: str | bytes | None = None,
        allowed_clients: Iterable[str | bytes] = (),
    ) -> None:
        spub = _z85_key("server_public", server_public)
        ssec = None if server_secret is None else _z85_key("server_secret", server_secret)
        cpub = None if client_public is None else _z85_key("client_public", client_public)
        csec = None if client_secret is None else _z85_key("client_secret", client_secret)
        if isinstance(allowed_clients, (str, bytes)):
            raise ValueError("allowed_clients must be a collection of keys, not one key")
        allowed = {_z85_key("allowed_clients entry", k) for k in allowed_clients}
        if ssec is not None:
            _check_pair("server", spub, ssec)
        if (cpub is None) != (csec is None):
            raise ValueError("client_public and client_secret must be given together")
        if cpub is not None and csec is not None:
            _check_pair("client", cpub, csec)
            allowed.add(cpub)
        for name, value in (
            ("server_public", spub),
            ("server_secret", ssec),
            ("client_public", cpub),
            ("client_secret", csec),
            ("allowed_clients", frozenset(allowed)),
        ):
            object.__setattr__(self, name, value)

    @staticmethod
    def keypair() -> tuple[str, str]:
        """A fresh CURVE key pair: ``(public, secret)``."""
        public, secret = zmq.curve_keypair()
        return public.decode("ascii"), secret.decode("ascii")

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh keys: a server key pair and one client key pair that every worker shares."""
        server_public, server_secret = cls.keypair()
        client_public, client_secret = cls.keypair()
        return cls(
            server_public=server_public,
            server_secret=server_secret,
            client_public=client_public,
            client_secret=client_secret,
        )

    def allowing(self, *client_publics: str | bytes) -> CurveKeys:
        """A copy whose sender also accepts these client public keys."""
        return self._replace(allowed_clients=self.allowed_clients | set(client_publics))

    def for_receiver(
        self, client_public: str | bytes | None = None, client_secret: str | bytes | None = None
    ) -> CurveKeys:
        """The keys a worker needs: no server secret; optionally the worker's own key pair.

        A worker given its own key pair is admitted only if the sender's keys allow its
        public key (see :meth:`allowing`).
        """
        if client_public is None and client_secret is None:
            client_public, client_secret = self.client_public, self.client_secret
        return self._replace(
            server_secret=None, client_public=client_public, client_secret=client_secret
        )

    def _replace(self, **changes: Any) -> CurveKeys:
        fields: dict[str, Any] = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return CurveKeys(**fields)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CurveKeys is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("CurveKeys is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        state = {name: getattr(self, name) for name in self.__slots__ if name != "server_secret"}
        state["allowed_clients"] = sorted(self.allowed_clients)
        return (_unpickle, (state,))

    def __copy__(self) -> CurveKeys:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> CurveKeys:
        return self

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CurveKeys) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        # Secrets never appear in reprs, logs or tracebacks.
        return (
            f"CurveKeys(server_public={self.server_public!r}, "
            f"server_secret={'<hidden>' if self.server_secret else None}, "
            f"client_public={self.client_public!r}, "
            f"client_secret={'<hidden>' if self.client_secret else None}, "
            f"allowed_clients=<{len(self.allowed_clients)} keys>)"
        )


def _unpickle(state: dict[str, Any]) -> CurveKeys:
    return CurveKeys(**state)


class _AllowedKeys:
    """The ZAP credentials provider: accepts exactly the configured client public keys."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self._allowed = frozenset(k.encode("ascii") for k in allowed)
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._allowed:
            return True
        self.refused += 1
        if worth_logging(self.refused):
            log.warning(
                "refused a control connection with an unknown CURVE client key %s "
                "(%d refused so far)",
                key.decode("ascii", "replace"),
                self.refused,
            )
        return False


class _Authenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's ZAP thread, with a stop that waits for the thread under a deadline, and an
    optional check of the peer's user on Unix-socket connections (``users``)."""

    users: frozenset[int] | None = None
    """When set, only peers whose process runs as one of these uids are admitted."""
    refused_users = 0
    stuck = False
    """The thread did not stop when told to (its socket stays open)."""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if self.users is not None and len(msg) >= 6:
            uid = _peer_uid(msg[3])
            if uid is None or uid not in self.users:
                self.refused_users += 1
                if worth_logging(self.refused_users):
                    log.warning(
                        "refused a control connection from a process of another user "
                        "(peer %s; %d refused so far)",
                        msg[3].decode("ascii", "replace"),
                        self.refused_users,
                    )
                self._send_zap_reply(msg[1], b"400", b"another user")
                return
            # Admitted: the reply names the peer's process, which the kernel gave (every
            # message of the connection carries it as its User-Id).
            self._send_zap_reply(msg[1], b"200", b"OK", user_id=f"pid:{_peer_pid(msg[3])}")
            return
        await super().handle_zap_message(msg)

    def stop(self) -> None:
        if self.pipe is not None:
            try:
                self.pipe.send(b"TERMINATE", zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("could not stop the ZAP thread: %s", exc)
            if self.thread is not None:
                self.thread.join(_STOP_WAIT)
                if self.thread.is_alive():
                    log.warning("the ZAP thread did not stop within %g s", _STOP_WAIT)
                    self.stuck = True
            self.thread = None  # type: ignore[assignment]
            self.pipe.close(linger=0)
            self.pipe = None  # type: ignore[assignment]
        zmq.auth.Authenticator.stop(self)


def _peer_uid(address: bytes) -> int | None:
    """The uid in a ZAP request's address for a Unix-socket peer, which libzmq fills from the
    kernel's peer credentials as ``localhost:<uid>:<gid>:<pid>``; None for anything else."""
    parts = address.split(b":")
    if len(parts) != 4 or parts[0] != b"localhost" or not parts[1].isdigit():
        return None
    return int(parts[1])


def _peer_pid(address: bytes) -> int:
    """The pid in a Unix-socket peer's ZAP address (see :func:`_peer_uid`); 0 if none."""
    parts = address.split(b":")
    return int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else 0


class SameUserServer:
    """The sender side of an unauthenticated Unix-socket channel: a ZAP handler on ``ctx``
    that admits only processes running as this process's user (or as root, who can read the
    slot files anyway), from the peer credentials the kernel gives for the connection."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self._auth = _Authenticator(ctx, log=log)
        self._auth.users = frozenset({os.getuid(), 0})
        try:
            # Running before the ROUTER binds, as for CURVE (see CurveServer).
            self._auth.start()
        except (zmq.ZMQError, RuntimeError) as exc:
            self.close()
            raise TransportError(f"cannot start the peer-credentials check: {exc}") from None

    @property
    def refused(self) -> int:
        """Connections refused so far because their process ran as another user."""
        return self._auth.refused_users

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode("ascii"))
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        # libzmq closes another user's connection as it accepts it, before it costs the
        # sender anything: unfiltered, a user who opens many silent connections to an abstract
        # socket (no file permissions) holds one of the sender's descriptors each until the
        # handshake limit, and once they run out libzmq aborts the process. The ZAP check
        # above stays for a libzmq built without the filter.
        try:
            for uid in sorted(self._auth.users or ()):
                sock.setsockopt(zmq.IPC_FILTER_UID, uid)
        except (zmq.ZMQError, AttributeError) as exc:
            log.info("no uid filter on the Unix socket (%s): other users are refused later", exc)

    def close(self) -> None:
        self._auth.stop()

    @property
    def stuck(self) -> bool:
        """The ZAP thread did not stop when closed: the context cannot end yet."""
        return self._auth.stuck


def check_server_keys(keys: CurveKeys) -> None:
    """``ValueError`` unless ``keys`` can serve as the sender's (secret and allowed clients)."""
    if keys.server_secret is None:
        raise ValueError(
            "these CurveKeys have no server_secret (pickling drops it, so keys a worker "
            "received cannot serve): the sender needs the CurveKeys it generated"
        )
    if not keys.allowed_clients:
        raise ValueError("these CurveKeys allow no client public key: nobody could connect")


def client_options(keys: CurveKeys) -> dict[int, bytes]:
    """The socket options that make a DEALER a CURVE client of the sender ``keys`` name."""
    if keys.client_public is None or keys.client_secret is None:
        raise ValueError("these CurveKeys have no client key pair: a receiver needs one")
    return {
        zmq.CURVE_SERVERKEY: keys.server_public.encode("ascii"),
        zmq.CURVE_PUBLICKEY: keys.client_public.encode("ascii"),
        zmq.CURVE_SECRETKEY: keys.client_secret.encode("ascii"),
    }


class CurveServer:
    """The sender side of CURVE: a running ZAP handler on ``ctx`` and the ROUTER's options."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        check_server_keys(keys)
        assert keys.server_secret is not None
        self._secret = keys.server_secret.encode("ascii")
        self.provider = _AllowedKeys(keys.allowed_clients)
        self._auth = _Authenticator(ctx, log=log)
        try:
            # The handler must be bound before the ROUTER accepts anyone: libzmq admits CURVE
            # clients unchecked when no ZAP handler exists (ZAP_ENFORCE_DOMAIN also closes that).
            self._auth.start()
            self._auth.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=self.provider)
        except (zmq.ZMQError, RuntimeError) as exc:
            self.close()
            raise TransportError(f"cannot start the CURVE authenticator: {exc}") from None

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode("ascii"))
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def close(self) -> None:
        self._auth.stop()

    @property
    def stuck(self) -> bool:
        """The ZAP thread did not stop when closed: the context cannot end yet."""
        return self._auth.stuck
