"""The receivers' half of the torch.distributed plane: each model's two private halves.

A receiver keeps two copies of each model of the scheme (one, or several with ``models=``):
the model runs one, and a version is received into the other. A version that moves some
models only (a send of some of them) is received into their idle halves; the others run on
from the halves they are in. The model is switched to the new halves only once every bucket
of the version arrived.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import torch

from aiowsync._exceptions import ProtocolError, TransportError
from aiowsync._protocol import ParamValue
from aiowsync._util.daemon import in_daemon_thread
from aiowsync._util.text import first_line
from aiowsync._weights.layout import Layout

from ..base import ReceiverPlane, Staged
from ..digest import Chunks, DigestMismatch, trailer_key, trailer_size, unseal
from ..double import DoubleBuffer
from .buckets import Buckets, section_spans
from .chain import ChainLimits, receive_and_forward
from .collectives import Backend, finish, seconds_left
from .groups import ReceiverGroups, host_of, local_ip_towards

__all__ = ["DistReceiverPlane"]

log = logging.getLogger("aiowsync.dist")

_COMBINED_KEPT = 4
"""Combinations of halves kept built (the one running, the one arriving, a few before)."""


class DistReceiverPlane(ReceiverPlane):
    """Two private halves per model on the model's device; each version is received into
    the idle halves of the models it moves."""

    def __init__(
        self, *, address: str, worker_idx: int, backend: Backend, device: torch.device
    ) -> None:
        self.sender_host = host_of(address)
        self._worker_idx = worker_idx
        self.backend: Backend = backend
        self.device = device
        self._groups = ReceiverGroups(backend)

    def setup(
        self, layout: Layout, welcome: Mapping[str, ParamValue], *, swap: bool = True
    ) -> None:
        self.layout = layout
        port, key, backend, bucket_bytes = (
            welcome.get("store_port"),
            welcome.get("store_key"),
            welcome.get("backend"),
            welcome.get("bucket_bytes"),
        )
        if not isinstance(port, int) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ProtocolError("the welcome lacks the store port or bucket size")
        try:
            self._store_key = bytes.fromhex(key) if isinstance(key, str) else b""
        except ValueError:
            self._store_key = b""
        if len(self._store_key) != 32:
            raise ProtocolError("the welcome lacks the key to the sender's store")
        if backend != self.backend:
            raise ProtocolError(
                f"the sender uses backend {backend!r}, this receiver {self.backend!r}"
            )
        self._spans = section_spans(layout)
        self.buckets = Buckets(layout.total_bytes, bucket_bytes, self._spans)
        self._chunks = Chunks(layout, self.buckets.ranges)
        # The store and the groups listen on the sender's data host, which need not be the
        # host of the control address (another interface, or a control socket on 0.0.0.0).
        store_host = welcome.get("store_host")
        if isinstance(store_host, str) and store_host:
            self.sender_host = store_host
        self._hostname = local_ip_towards(self.sender_host)
        names = list(layout.sections)
        self._names = names
        self._halves = [
            DoubleBuffer(layout.subset([n]) if layout.sectioned else layout, self.device)
            for n in names
        ]
        self._newest = [-1] * len(names)
        """Per model, the half holding the newest bytes received (the model may run the
        other one still, or, in copy mode, none)."""
        self._hashes: list[list[dict[int, int]]] = [[{}, {}] for _ in names]
        """Per model and half, the digest buckets hashed as they arrived."""
        self._combined: collections.OrderedDict[tuple[int, ...], Staged] = (
            collections.OrderedDict()
        )
        """A version as the model runs it: one half of each model, by the halves' indices
        (the few latest; models sent in changing subsets make up to 2**models of them)."""
        self._port = port

    async def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        # On shutdown the wait is abandoned, and a second past the receive's deadline too:
        # gloo may overrun it while a group forms (connecting to a member that died in the
        # meantime takes it several times its limit). The thread ends by itself, and
        # receives nothing once past its deadline.
        timeout_ms = params.get("timeout_ms")
        limit = timeout_ms / 1000 + 1.0 if isinstance(timeout_ms, int) else None
        with anyio.move_on_after(limit):
            # A daemon thread: one abandoned at shutdown must not hold up the process's exit
            # until its deadline.
            return await in_daemon_thread(self.fetch_blocking, params, name="aiowsync-receive")
        raise TransportError("receiving the version failed: it ran past its deadline")

    def fetch_blocking(self, params: Mapping[str, ParamValue]) -> Staged:
        """Receive the announced version into the idle halves of the models it moves
        (blocking)."""
        name, members, timeout_ms, form_ms = (
            params.get("group"),
            params.get("members"),
            params.get("timeout_ms"),
            params.get("form_ms", params.get("timeout_ms")),
        )
        if not isinstance(name, str) or not isinstance(members, str):
            raise ProtocolError(f"update parameters lack a group: {dict(params)}")
        if not isinstance(timeout_ms, int) or timeout_ms <= 0:
            raise ProtocolError(f"update parameters lack a positive timeout: {dict(params)}")
        if not isinstance(form_ms, int) or form_ms <= 0:
            raise ProtocolError(f"update parameters have a bad group timeout: {dict(params)}")
        try:
            workers = [int(w) for w in members.split(",")]
        except ValueError:
            raise ProtocolError(f"bad member list {members!r}") from None
        moved = self._moved(params.get("sections"))
        if self._groups.is_dead(name):
            raise TransportError(f"group {name} was torn down after an earlier failure")
        deadline = time.monotonic() + timeout_ms / 1000
        # The idle halves of the models moved (garbage until every bucket arrived), and the
        # live halves of the others.
        choice = []
        for number, halves in enumerate(self._halves):
            if number in moved:
                choice.append(halves.spare()[0])
            elif self._newest[number] < 0:
                raise ProtocolError(f"model {self._names[number]!r} was never received")
            else:
                choice.append(self._newest[number])
        if self._worker_idx not in workers:
            raise ProtocolError(f"worker {self._worker_idx} is not a member of {members!r}")
        targets = [
            (index, self._slice(index, choice))
            for index, span in enumerate(self.buckets.span_of)
            if span in moved
        ]
        for number in moved:
            self._hashes[number][choice[number]] = {}
        key = trailer_key(params.get("digest"))
        sealed = None
        if key is not None:
            # The sender's digest follows the last bucket; each bucket is hashed as it comes.
            sealed = torch.zeros(trailer_size(self.layout), dtype=torch.uint8, device=self.device)
            targets.append((len(self.buckets.ranges), sealed))
        cached = self._groups.cached(name)
        chain = params.get("topology") == "chain"
        limits = ChainLimits.from_params(params) if chain else None
        held: list[Any] = []
        """The transfer's references to its group and pending work, let go on failure."""
        failure = None
        arrived = None if key is None else self._hasher(choice)
        try:
            self._receive(
                name,
                cached,
                workers,
                targets,
                deadline,
                form_ms / 1000,
                chain,
                limits,
                held,
                arrived,
            )
        except (RuntimeError, ValueError, TransportError) as exc:
            failure = first_line(exc)
        if failure is not None:
            # Outside the handler, so that no traceback keeps the failed group alive.
            # Let go now (in a thread): its connections close, so that the sender (and in a
            # chain, the member after this one) fails at once instead of at the deadline.
            cached = None
            self._groups.discard(name, *held)
            held.clear()
            raise TransportError(f"receiving the version failed: {failure}")
        text = None if key is None or sealed is None else self._check(sealed, key, choice)
        for number in moved:
            self._newest[number] = choice[number]
        staged = self._staged(tuple(choice))
        return staged if text is None else dataclasses.replace(staged, digest=text)

    def _hasher(self, choice: list[int]) -> Callable[[int], None]:
        """What hashes bucket ``index`` once it arrived into the halves of ``choice``."""
        chunks, n = self._chunks, len(self.buckets.ranges)

        def arrived(index: int) -> None:
            if index >= n:
                return  # the digest itself
            span = self.buckets.span_of[index]
            flat, base = self._halves[span].flats[choice[span]], self._spans[span][0]
            hashes = self._hashes[span][choice[span]]
            for chunk in chunks.completed_by[index]:
                hashes[chunk] = chunks.hash(flat, chunk, base)

        return arrived

    def _check(self, sealed: torch.Tensor, key: bytes, choice: list[int]) -> str:
        """The sender's digest, which followed the bytes, once the bytes of ``choice`` (the
        models received now and those run on from before) are checked against it; raises
        :class:`DigestMismatch` otherwise."""
        text = unseal(sealed.cpu().numpy().tobytes(), key)
        chunks = self._chunks
        got: list[int] = []
        for number, (lo, hi) in enumerate(self._spans):
            half = choice[number]
            hashes, flat = self._hashes[number][half], self._halves[number].flats[half]
            for chunk in chunks.within(lo, hi):
                if chunk not in hashes:  # a model run on, received without a digest
                    hashes[chunk] = chunks.hash(flat, chunk, lo)
                got.append(hashes[chunk])
        chunks.check(got, text)
        return text

    def _moved(self, value: ParamValue | None) -> set[int]:
        """The models an update moves (every one when it does not say)."""
        if value is None:
            return set(range(len(self._halves)))
        if not isinstance(value, str):
            raise ProtocolError(f"bad list of models {value!r}")
        try:
            moved = {int(n) for n in value.split(",")} if value else set()
        except ValueError:
            raise ProtocolError(f"bad list of models {value[:80]!r}") from None
        if not moved <= set(range(len(self._halves))):
            raise ProtocolError(f"the update names models this layout does not have: {value!r}")
        return moved

    def _slice(self, bucket: int, choice: list[int]) -> torch.Tensor:
        """Where bucket ``bucket`` lands: its bytes of the chosen half of its model."""
        lo, hi = self.buckets.ranges[bucket]
        span = self.buckets.span_of[bucket]
        start = self._spans[span][0]
        return self._halves[span].flats[choice[span]][lo - start : hi - start]

    def _staged(self, choice: tuple[int, ...]) -> Staged:
        staged = self._combined.get(choice)
        if staged is None:
            halves = [h.halves[i] for h, i in zip(self._halves, choice, strict=True)]
            parts = [p for half in halves for p in half.buffers]
            views = {k: v for half in halves for k, v in half.views.items()}
            staged = Staged(parts, views, ",".join(map(str, choice)))
            self._combined[choice] = staged
            while len(self._combined) > _COMBINED_KEPT:
                self._combined.popitem(last=False)
        self._combined.move_to_end(choice)
        return staged

    def _receive(
        self,
        name: str,
        cached: Any,
        workers: list[int],
        targets: list[tuple[int, torch.Tensor]],
        deadline: float,
        form: float,
        chain: bool,
        limits: ChainLimits | None,
        held: list[Any],
        arrived: Callable[[int], None] | None,
    ) -> None:
        rank = workers.index(self._worker_idx) + 1
        if cached is None:
            store_at = (self.sender_host, self._port, self._store_key)
            pg = self._groups.join(
                store_at, name, rank, len(workers) + 1, self._hostname, deadline, form
            )
        else:
            pg = cached
        held.append(pg)
        seconds_left(deadline)  # a group that formed too late receives nothing
        if not chain:
            works = [pg.recv([dst], 0, index) for index, dst in targets]
            held.append(works)
            for (index, _), work in zip(targets, works, strict=True):
                finish(work, self.backend, seconds_left(deadline), self.device)
                if arrived is not None:
                    arrived(index)  # while the next buckets come in
            self._groups.keep(name, pg)
            return
        # A chain: every bucket comes from the member before, and goes on to the member after.
        broken = receive_and_forward(
            pg,
            rank,
            workers,
            targets,
            deadline=deadline,
            limits=limits,
            backend=self.backend,
            device=self.device,
            held=held,
            arrived=arrived,
        )
        if broken:
            # This member has the whole version; the one after it fails and says so. The
            # group is not kept: its link to the member after is broken.
            log.warning(
                "worker %d: forwarding to the next member failed: %s", self._worker_idx, broken
            )
            # The references ``held`` hands over must be the last ones.
            pg = cached = None
            self._groups.discard(name, *held)
            held.clear()
        else:
            self._groups.keep(name, pg)

    def show(self, staged: Staged) -> Staged:
        for halves, index in zip(self._halves, map(int, staged.source.split(",")), strict=True):
            halves.made_live(index)
        return staged

    def close(self) -> None:
        self._groups.close()
