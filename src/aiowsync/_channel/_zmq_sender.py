"""The sender's end of the ZeroMQ control channel: a ROUTER that every receiver connects to."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import zmq

from .._exceptions import TransportError
from .._protocol import MAX_FRAME, Message, encode
from .._util.sched import zmq_io_threads
from ._address import resolve_local, transport
from ._auth import CurveKeys, CurveServer, SameUserServer
from ._base import PeerId, SenderChannel, timeout_error
from ._fdwait import POLLIN, ZmqEnd, deadline_after
from ._socket_dir import (
    claim_socket_dir,
    missing_socket,
    owned_socket_dir,
    remove_owned_socket_dir,
)
from ._socket_file import BoundFile, check_free, socket_file
from ._zmq_options import (
    DROPS_PER_TURN,
    HANDSHAKE_MS,
    PEER_CREDENTIALS,
    PIDS_KEPT,
    QUEUED_PER_PEER,
    base_options,
    check_open_abstract_socket,
    ip_version_for,
    raise_open_files_limit,
    terminate,
    unpredictable_generated_ids,
)

__all__ = ["ZmqSenderChannel"]

log = logging.getLogger("aiowsync.channel")


class ZmqSenderChannel(ZmqEnd, SenderChannel):
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        heartbeat_timeout: float,
        curve: CurveKeys | None = None,
        *,
        other_users: bool = False,
        max_message: int | None = None,
    ) -> None:
        self._io_before = zmq_io_threads()
        address = resolve_local(address)
        self._pids: collections.OrderedDict[PeerId, int] = collections.OrderedDict()
        """By routing id, the pid the kernel gave for the peer's process (Unix sockets)."""
        self._bound_file: BoundFile | None = None
        """A socket file at a path the user chose, removed at close if still ours."""
        unix = transport(address) == "ipc"
        same_user = unix and curve is None and not other_users and PEER_CREDENTIALS
        raise_open_files_limit()
        try:
            if address.startswith("ipc://@") and not same_user:
                check_open_abstract_socket(address)
            self._socket_dir = claim_socket_dir(address)
            """The private directory of the socket, removed with it (see LOCAL_BIND)."""
            chosen = socket_file(address) if self._socket_dir is None else None
            if chosen is not None:
                check_free(chosen)
        except OSError as exc:
            ctx.term()
            raise TransportError(f"cannot bind {address}: {exc}") from None
        except BaseException:
            ctx.term()
            raise
        self._auth: CurveServer | SameUserServer | None = None
        try:
            if curve is not None:
                self._auth = CurveServer(ctx, curve)
            elif same_user:
                self._auth = SameUserServer(ctx)
                self.user_ids = True  # the handler names each peer's process (its pid)
        except BaseException:
            ctx.term()
            raise
        unpredictable_generated_ids()
        ZmqEnd.__init__(self, ctx, zmq.ROUTER)
        SenderChannel.__init__(self)
        try:
            base_options(self._sock, heartbeat_timeout)
            if self._auth is not None:
                self._auth.apply(self._sock)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Receivers keep their routing id across reconnections (see the receiver channel);
            # the newest connection under an id takes it over.
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # A peer that sends more than the sender's receivers ever need to is cut off
            # before its message is read, and none may queue more than a few messages.
            limit = MAX_FRAME if max_message is None else min(max_message, MAX_FRAME)
            self._sock.setsockopt(zmq.MAXMSGSIZE, limit + 1024)
            self._sock.setsockopt(zmq.RCVHWM, QUEUED_PER_PEER)
            # A connection that does not finish ZeroMQ's handshake (a peer that connects and
            # says nothing) is dropped after this long, giving back its descriptor.
            self._sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            ip_version_for(self._sock, address)
            if transport(address) == "tcp" and address.rpartition(":")[2] == "0":
                host = address.rsplit(":", 1)[0] if address.count(":") > 1 else address
                self._sock.bind(f"{host}:*")
            else:
                self._sock.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot bind {address}: {exc}") from None
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if chosen is not None:
            with contextlib.suppress(OSError):
                self._bound_file = BoundFile(chosen)

    async def send_frame(self, peer: PeerId, frame: bytes, *, timeout: float | None) -> None:
        await self._send_frames([peer, frame], timeout)

    def send_nowait(self, peer: PeerId, message: Message) -> bool:
        return self._try_send(peer, encode(message))

    async def recv(self, *, timeout: float | None) -> tuple[PeerId, Message]:
        deadline = deadline_after(timeout)
        dropped = 0
        while True:
            remaining = None if timeout is None else max(0.0, deadline - time.monotonic())
            got = self._accept(await self._recv_frames(remaining))
            if got is not None:
                return got
            dropped += 1
            if dropped % DROPS_PER_TURN == 0:
                # A peer sending junk as fast as it can must not keep the loop to itself,
                # nor this call past its deadline.
                await asyncio.sleep(0)
                if time.monotonic() >= deadline:
                    raise timeout_error("message", timeout)

    def recv_nowait(self) -> tuple[PeerId, Message] | None:
        for _ in range(DROPS_PER_TURN):
            if not self._ready(POLLIN) or (frames := self._recv_frames_nowait()) is None:
                return None
            got = self._accept(frames)
            if got is not None:
                return got
        return None  # only junk so far: the rest waits for the next call

    def _accept(self, frames: list[bytes]) -> tuple[PeerId, Message] | None:
        if len(frames) != 2:
            self._count_drop("a message of %d frames", len(frames))
            return None
        message = self._decode_or_drop(frames[1], f"peer {frames[0].hex()}")
        if message is None:
            return None
        if self.user_ids:
            self._remember_pid(frames[0])
        return frames[0], message

    def _remember_pid(self, peer: PeerId) -> None:
        user = self.user_id or ""
        if user.startswith("pid:") and user[4:].isdigit():
            self._pids[peer] = int(user[4:])
            self._pids.move_to_end(peer)
            while len(self._pids) > PIDS_KEPT:
                self._pids.popitem(last=False)

    def peer_pid(self, peer: PeerId) -> int | None:
        return self._pids.get(peer)

    def keep_bound(self) -> None:
        """Bind the socket in its private directory again if its file is gone (removed by
        hand, by a cleaner of the temporary directory, or by an older sweep that could not
        see this process): workers connected already stay connected, and new ones can join."""
        if self.closed or owned_socket_dir(self.address) is None:
            return
        path = missing_socket(self.address)
        if path is None:
            return
        log.warning("the sender's socket %s was removed: binding it again", path)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.unbind(self.address)
        if self._socket_dir is not None:
            remove_owned_socket_dir(self._socket_dir)  # what is left of it, and its lock
            self._socket_dir = None
        try:
            self._socket_dir = claim_socket_dir(self.address)
            self._sock.bind(self.address)
        except (OSError, zmq.ZMQError) as exc:
            log.warning("could not bind %s again (will retry): %s", self.address, exc)

    def close(self) -> None:
        self.closed = True
        self._close_socket()
        stuck = False
        if self._auth is not None:
            self._auth.close()
            stuck = self._auth.stuck
        terminate(self._ctx, wait=not stuck)
        if self._bound_file is not None:
            self._bound_file.remove()
            self._bound_file = None
        if self._socket_dir is not None:
            remove_owned_socket_dir(self._socket_dir)
            self._socket_dir = None
