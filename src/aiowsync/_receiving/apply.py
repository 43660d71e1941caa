"""How a receiver switches its model to a fetched version: tear-free, under the read guard."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Literal, TypeAlias

import anyio
import torch

from .._config import Timeouts
from .._copy.engine import fused_copy
from .._exceptions import NotConnectedError, WeightSyncTimeout
from .._planes.base import ReceiverPlane, Staged
from .._planes.digest import DigestMismatch, check_digest, trailer_key
from .._planes.double import DoubleBuffer
from .._protocol import ParamValue
from .._util.shield import to_the_end
from .._weights.binding import bind_views
from .._weights.layout import Layout
from .guard import ReadGuard

__all__ = ["ApplyMode", "Applier", "Hook", "Superseded", "Tenure"]

log = logging.getLogger("aiowsync.receiver")

ApplyMode: TypeAlias = Literal["swap", "copy"]
Hook: TypeAlias = Callable[[int], Awaitable[None] | None]


class Superseded(NotConnectedError):
    """The model follows another applier now (its receiver joined a new sender): what this
    one holds is no longer the version the model runs."""


class Tenure:
    """Which :class:`Applier` the model's tensors follow: the last that switched them.

    A receiver that follows its sender across restarts makes an applier per sender, all on
    one model; they share this record, so that the one left behind knows, under the read
    guard, that the model moved on (it then lends nothing and gives the model nothing).
    """

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: Applier | None = None


class Applier:
    """Binds ``targets`` (the model's tensors) to each new version.

    Swap mode re-points the tensors at what the plane fetched; copy mode copies it into the
    spare half of a private double buffer first. Either way the switch happens at one instant,
    when no reader holds the guard; ``on_switch`` is called right after it.

    ``tenure`` and ``private`` come from the applier of the sender before, when the receiver
    joined a new one: the record of who drives the model, and copy mode's two private copies
    (the model runs one of them; the new sender's first version goes into the other).
    """

    def __init__(
        self,
        *,
        plane: ReceiverPlane,
        layout: Layout,
        targets: Mapping[str, torch.Tensor],
        mode: ApplyMode,
        model_layout: Layout | None = None,
        guard: ReadGuard,
        hooks: list[Hook],
        timeouts: Timeouts,
        on_switch: Callable[[], None],
        tenure: Tenure | None = None,
        private: DoubleBuffer | None = None,
    ) -> None:
        self.plane = plane
        self.layout = layout
        self._targets = dict(targets)
        self.mode = mode
        self.guard = guard
        self.hooks = hooks
        self._timeouts = timeouts
        self._on_switch = on_switch
        self.version = -1
        self.digest: tuple[int, str] | None = None
        """The sender's digest of the version the model runs, and that version, if the
        update carried one (a relay hands it on to its leaves)."""
        self.generation = 0
        """Which sender ``version`` counts in: 0 for the receiver's first, one more for each
        new sender it followed (a restarted trainer numbers its versions from 0 again)."""
        self.tenure = tenure or Tenure()
        self._live: Staged | None = None
        self._fetched: Staged | None = None
        """Swap mode: the version the model runs as the plane fetched it (``_live`` may be a
        window showing it)."""
        self._private: DoubleBuffer | None = None
        self.model_layout = model_layout or layout
        """The model's own dtypes; not ``layout`` when a wire dtype casts (copy mode then)."""
        if mode == "copy":
            if private is None:
                device = next(iter(self._targets.values())).device if self._targets else "cpu"
                private = DoubleBuffer(self.model_layout, device)
            self._private = private
        self.detached = False
        """The model reads no memory of the sender's any more (set by :meth:`detach`)."""

    def switch_now(
        self, version: int, params: Mapping[str, ParamValue], check: Callable[[], None]
    ) -> bool | Exception:
        """Switch to ``version`` right here if that needs no wait: swap mode, no hooks, the
        bytes in place, no reader in the guard. False if it must go through :meth:`apply`.
        Otherwise ``check()`` runs first (it may raise, and nothing switches); then True, or
        the exception that fetching or switching raised (nothing switched)."""
        if self.hooks or self.mode != "swap" or "digest" in params:
            return False  # a digest is checked in a thread, by apply()
        failure: Exception | None = None
        try:
            staged = self.plane.fetch_nowait(params)
        except Exception as exc:
            staged, failure = None, exc
        if staged is None and failure is None:
            return False  # the bytes are not in place: apply() waits for them

        def switch() -> bool | Exception:
            check()
            if failure is not None:
                return failure
            assert staged is not None
            try:
                self._commit(version, staged)
            except Exception as exc:
                return exc
            return True

        try:
            return self.guard.switch_nowait(switch)
        except anyio.WouldBlock:
            return False

    async def apply(self, version: int, params: Mapping[str, ParamValue]) -> None:
        staged = self.plane.fetch_nowait(params)
        if staged is None:
            staged = await self.plane.fetch(params)
        expected = params.get("digest")
        if trailer_key(expected) is not None:
            # The digest followed the bytes, and the plane checked them as they came.
            if staged.digest is None:
                raise DigestMismatch("the version came without the digest its update promised")
            expected = staged.digest
        elif expected is not None:
            # Before anything switches or is copied: bytes that differ are never applied. (A
            # slot window's version has no buffers of its own: its slot file is read.)
            buffers = staged.buffers or self.plane.lease_buffers(staged) or []
            check = functools.partial(check_digest, self.layout, buffers, str(expected))
            await to_the_end(anyio.to_thread.run_sync(check))
        index = -1
        if self._private is not None:
            index, target = self._private.spare()
            # The spare copy is read by nothing: the model points at the other one. The copy
            # ends before this returns, even if cancelled, so two never overlap in it.
            if self.model_layout is self.layout:
                copy = functools.partial(copy_buffers, target.buffers, staged.buffers)
            else:  # from the wire dtype to the model's, tensor by tensor
                source = staged.views or self.layout.views(staged.buffers)
                keys = self.layout.keys
                copy = functools.partial(
                    fused_copy, [target.views[k] for k in keys], [source[k] for k in keys]
                )
            await to_the_end(anyio.to_thread.run_sync(copy))
            staged = target
        private = self._private

        def commit() -> None:
            self._commit(version, staged)
            self.digest = None if expected is None else (version, str(expected))
            if private is not None:
                # Only now is the other half the spare: after a switch that did not happen,
                # the model still reads the old one, which the next copy must not touch.
                private.made_live(index)

        try:
            await self.guard.switch(commit, timeout=self._timeouts.ack)
        except TimeoutError:
            raise WeightSyncTimeout(
                f"readers held the read guard for {self._timeouts.ack:g} s; version {version} "
                "was not switched in"
            ) from None

    def _commit(self, version: int, staged: Staged, *, private: bool = False) -> None:
        fetched = staged
        if self.mode == "swap" and not private:
            staged = self.plane.show(staged)
        if staged is not self._live:
            layout = self.model_layout if private else self.layout
            bind_views(self._targets, staged.views or layout.views(staged.buffers))
            if staged.bind_once:
                staged.views.clear()
        self._live = staged
        self._fetched = fetched if self.mode == "swap" and not private else None
        self.version = version
        self.tenure.current = self
        self._on_switch()

    @property
    def private(self) -> DoubleBuffer | None:
        """Copy mode's two private copies (None in swap mode)."""
        return self._private

    @property
    def superseded(self) -> bool:
        """Another applier switched the model since this one did."""
        current = self.tenure.current
        return current is not None and current is not self

    def _check_current(self) -> None:
        if self.superseded:
            raise Superseded("the model follows a new sender now")

    # -- leases -------------------------------------------------------------------------------

    def lease_views(self) -> dict[str, torch.Tensor] | None:
        """Fresh views of the version the model runs, in the sender's memory, which the
        sender keeps while a lease reports it; None where the version lies in memory of this
        receiver's own that later versions rewrite (a lease copies it then). Call where no
        switch can be under way."""
        fetched = self._fetched
        if fetched is None or not fetched.shared:
            return None
        buffers = self.plane.lease_buffers(fetched)
        return None if buffers is None else self.layout.views(buffers)

    def copy_live(self) -> dict[str, torch.Tensor]:
        """A private copy of the version the model runs, on the model's device and in its
        dtypes, by key. Call holding the guard. Raises :class:`Superseded` once another
        applier drives the model (which may be writing this one's copies)."""
        self._check_current()
        live = self._live
        assert live is not None, "a lease is taken once a version runs"
        # Swap mode needs the model's dtypes on the wire, so its layout is the model's too.
        return self.model_layout.views([b.clone() for b in live.buffers])

    async def run_hooks(self, version: int) -> None:
        with anyio.fail_after(self._timeouts.ack):
            for hook in list(self.hooks):
                result = hook(version)
                if inspect.isawaitable(result):
                    await result

    async def detach(self) -> None:
        """Give the model a private copy of its weights if it reads the sender's memory.

        After the goodbye the sender may reuse the slot this model reads, and the model
        outlives the scheme; so it keeps the same values in memory of its own.
        """
        self.detached = False
        live = self._live
        if self.superseded or self.mode != "swap" or live is None or not live.shared:
            # Superseded: the model is another applier's to look after.
            self.detached = True
            return
        device = live.buffers[0].device if live.buffers else torch.device("cpu")
        buffers = self.layout.allocate(device)
        await anyio.to_thread.run_sync(copy_buffers, buffers, live.buffers)
        own = Staged(buffers, self.layout.views(buffers))
        await self.guard.switch(
            lambda: self._commit(self.version, own, private=True), timeout=self._timeouts.ack
        )
        self.detached = True


def copy_buffers(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
