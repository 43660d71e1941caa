"""One vLLM worker's side of the trainer's scheme: a receiver, and versions applied from leases.

:class:`WorkerReceiver` knows nothing of vLLM: the engine hands it a ``reload`` function that
loads ``(name, tensor)`` pairs into the model through vLLM's own reload path, and a
``snapshot`` function for the model's current tensors. The receiver runs on a private event
loop in a background thread (see :func:`aiowsync.blocking`), so versions arrive while the server
generates. A version is applied from a lease: the lease keeps its bytes in place while newer
versions arrive, and the lease of the version applied before stays held until the next one has
been applied, so that a reload that fails half-way can be undone by applying it again.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import anyio
import torch

from .._receiving.lease import Lease
from .._scheme.blocking import BlockingScheme, blocking
from .._util.libc import libc
from ._describe import placeholders, rebuild

__all__ = ["FAULT_FILE_ENV", "Reload", "WorkerReceiver"]

log = logging.getLogger("aiowsync.vllm")

Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
"""Loads the pairs into the model (all of the model's weights, through vLLM's reload); on an
error it leaves the model out of its reload state (its values may be mixed) and raises."""

FAULT_FILE_ENV = "AIOWSYNC_VLLM_FAULT_FILE"
"""For tests of failure: a file that, when present, makes the next apply fail (read once,
then removed). Its JSON: ``{"fail": "reload", "after": N}`` raises after N tensors were loaded
(``"delay": S`` first waits S seconds);
``{"fail": "receive"}`` makes the receiver refuse the next version it is sent, and
``{"fail": "receive", "delay": S}`` answers for it S seconds late."""


class _Applied:
    """A version the model holds (or is taking): its tensors and the lease keeping them."""

    def __init__(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        lease: Lease | None,
        mine: bool,
        before: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.version = version
        self.tensors = tensors
        self.lease = lease
        self.mine = mine
        """A version of the trainer now attached (not one left by a trainer before, whose
        version numbers mean nothing to this one)."""
        self.before = before
        """For a version loaded over weights no trainer gave (the server's first), a copy of
        those weights, kept until the version is labelled, to undo it."""

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.__exit__(None, None, None)


class WorkerReceiver:
    """Receiver ``worker_idx`` of the scheme that ``description`` names, in a vLLM worker."""

    def __init__(
        self,
        description: dict[str, Any],
        worker_idx: int,
        *,
        reload: Reload,
        snapshot: Callable[[], dict[str, torch.Tensor]],
        restore: Callable[[dict[str, torch.Tensor]], None],
        server_url: str | None,
        previous: _Applied | None = None,
    ) -> None:
        self._reload = reload
        self._snapshot = snapshot
        self._restore = restore
        self._server_url = server_url
        self.worker_idx = worker_idx
        self._skip = frozenset(description.get("skip", ()))
        scheme = rebuild(description)
        self._model = placeholders(description)
        scheme.init_on_receiver(weights=self._model, worker_idx=worker_idx)
        if os.environ.get(FAULT_FILE_ENV):
            scheme.register_hook(self._refuse_if_told)
        scheme.register_hook(self._map_in)
        self._facade: BlockingScheme = blocking(scheme)
        self._applied = previous
        """The version the model holds, from this trainer or (copied) from the one before."""
        self._pending: _Applied | None = None
        """A version applied since the last ``finish`` (the previous one kept until then)."""
        self._closed = threading.Event()
        self._lock = threading.Lock()
        """Held while a version is applied, finished or undone (the engine's calls and the
        watch of the sender run in different threads)."""
        self._heartbeat = scheme.heartbeats.interval
        self._pages = PagesIn()
        self._facade.__enter__()
        try:
            self._facade.connect(timeout=scheme.timeouts.handshake)
        except BaseException:
            self._facade.close()
            raise
        self._watch = threading.Thread(
            target=self._watch_sender, name="aiowsync-vllm-watch", daemon=True
        )
        self._watch.start()

    @property
    def version(self) -> int:
        """The version the receiver holds (staged, not necessarily applied)."""
        return self._facade.version

    @property
    def applied(self) -> int | None:
        """The version the model holds, if it came from a trainer."""
        held = self._pending or self._applied
        return None if held is None else held.version

    # -- applying -----------------------------------------------------------------------------

    def apply(self, version: int, *, take_back: bool = False) -> None:
        """Load ``version`` into the model; on failure the model holds what it held before and
        the error is raised. With ``take_back``, undo the version applied since the last
        ``finish`` instead, if there is one (a load that failed, ran late or was cancelled on
        the trainer's side, or that the fleet could not take everywhere)."""
        with self._lock:  # a load still under way ends first
            if take_back:
                if self._pending is not None:
                    self._undo_pending()
                return
            self._apply(version)

    def _apply(self, version: int) -> None:
        pending = self._pending
        if pending is not None and version == pending.version:
            return  # asked twice
        if pending is None and self._applied is not None and self._is_applied(version):
            self._load(self._applied.tensors, undo=None)  # loaded again, as asked
            return
        lease = self._facade.lease()
        held = lease.__enter__()
        if held.version != version:
            lease.__exit__(None, None, None)
            raise RuntimeError(
                f"worker {self.worker_idx} holds version {held.version}, not {version}: the "
                "trainer asked for a version this worker did not receive"
            )
        tensors = {k: t for k, t in held.weights.flatten_keys(".").items() if k not in self._skip}
        if self._applied is not None:
            undo = None
        else:  # the server's own weights, from before any version it was sent
            undo = pending.before if pending is not None else self._snapshot()
        taking = _Applied(version, tensors, lease, mine=True, before=undo)
        # A version loaded and never labelled (its take-back failed) is replaced: a load that
        # fails goes back to what was labelled, not to it.
        self._pending = None
        try:
            self._load(tensors, undo=undo)
        except BaseException:
            taking.release()
            raise
        finally:
            if pending is not None:
                pending.release()
        self._pending = taking

    def _load(self, tensors: dict[str, torch.Tensor], undo: dict[str, torch.Tensor] | None) -> None:
        try:
            self._reload(_maybe_failing(tensors.items()))
        except BaseException as exc:
            log.warning(
                "worker %d: applying a version failed (%s); restoring", self.worker_idx, exc
            )
            if undo is not None:
                self._restore(undo)
            elif self._applied is not None:
                self._reload(self._applied.tensors.items())
            raise

    def _is_applied(self, version: int) -> bool:
        """``version`` of this trainer is the one the model held before any pending one."""
        held = self._applied
        return held is not None and held.mine and held.version == version

    def _undo_pending(self) -> None:
        """Back to what the model held before the pending version: the version applied before
        (loaded again), or the weights the server started with."""
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            if self._applied is not None:
                self._reload(self._applied.tensors.items())
            elif pending.before is not None:
                self._restore(pending.before)
        finally:
            pending.release()

    def _drop_unlabelled(self) -> None:
        """Undo a version loaded and never labelled, if any (the trainer that loaded it is
        gone): the server goes on with what it served before. A failure is logged."""
        if self._pending is None:
            return
        try:
            self._undo_pending()
        except Exception as exc:
            log.error("worker %d: could not undo a version: %s", self.worker_idx, exc)

    def finish(self) -> int | None:
        """The version applied since the last call becomes the one kept; the one before is
        released. Returns the version the model holds."""
        with self._lock:
            return self._finish()

    def _finish(self) -> int | None:
        pending, self._pending = self._pending, None
        if pending is not None:
            if self._applied is not None and self._applied is not pending:
                self._applied.release()
            pending.before = None  # labelled: no going back to the server's first weights
            self._applied = pending
        return self.applied

    def detach(self) -> _Applied | None:
        """Stop receiving; the version the model holds, copied out of the sender's memory (for
        undoing a failed apply under the next trainer)."""
        with self._lock:
            self._drop_unlabelled()
            applied, self._applied = self._applied, None
            kept = None
            if applied is not None:
                copy = {k: t.clone() for k, t in applied.tensors.items()}
                kept = _Applied(applied.version, copy, None, mine=False)
                applied.release()
        self.close()
        return kept

    def close(self) -> None:
        self._closed.set()
        with self._lock:  # not while the watch reloads from a lease
            for held in (self._pending, self._applied):
                if held is not None:
                    held.release()
            self._pending = self._applied = None
        self._facade.close()

    # -- staging ------------------------------------------------------------------------------

    async def _map_in(self, version: int) -> None:
        """Map the new version's pages into this process before the worker acks it (while
        the server generates), so that loading it in the pause reads memory, not page faults."""
        tensors = list(self._model.values())
        if self._pages.needed(tensors):
            await anyio.to_thread.run_sync(self._pages.map_in, tensors)

    # -- a trainer that goes away -------------------------------------------------------------

    def _watch_sender(self) -> None:
        """When the sender is gone, make sure the server is not left paused by it."""
        warned = False
        while not self._closed.wait(self._heartbeat):
            if self._facade.connected:
                warned = False
                continue
            if not warned:
                log.warning(
                    "worker %d: the trainer is gone; serving version %s until a trainer attaches",
                    self.worker_idx,
                    self.applied,
                )
                warned = True
            with self._lock:
                self._drop_unlabelled()
            if self._server_url is None:
                continue  # another worker of the server resumes it
            try:
                self._resume_if_paused()
            except OSError as exc:
                log.warning("worker %d: could not resume the server: %s", self.worker_idx, exc)

    def _resume_if_paused(self) -> None:
        url = self._server_url
        assert url is not None
        with urllib.request.urlopen(f"{url}/is_paused", timeout=5) as reply:
            paused = json.load(reply).get("is_paused")
        if paused:
            post = urllib.request.Request(f"{url}/resume", method="POST")
            with urllib.request.urlopen(post, timeout=5):
                log.warning(
                    "worker %d: resumed the server its trainer left paused", self.worker_idx
                )

    # -- faults, for tests --------------------------------------------------------------------

    async def _refuse_if_told(self, version: int) -> None:
        fault = _take_fault("receive")
        if fault is None:
            return
        if "delay" in fault:  # a worker that answers late
            await anyio.sleep(float(fault["delay"]))
            return
        raise RuntimeError(f"injected fault: receiving version {version} failed")


_MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels refuse it and the pages fault in later


class PagesIn:
    """Maps the pages of tensors' storages into this process, each storage once.

    A receiver keeps each slot file mapped from version to version, and a page once mapped
    stays mapped; so only a slot's first version has pages to map. Asking the kernel again
    is not free: it walks every page (about 50 ms for 610 MiB), on a core the server also
    generates on.
    """

    KEPT = 64
    """Past this many storages the record starts afresh (slots are re-made over time)."""

    def __init__(self) -> None:
        self._done: set[tuple[int, int]] = set()

    def needed(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` lies in a storage not mapped in yet."""
        return not _storages(tensors) <= self._done

    def map_in(self, tensors: Iterable[torch.Tensor]) -> set[tuple[int, int]]:
        """Map the storages of ``tensors`` not mapped in before; returns them, each as
        (address, size)."""
        new = _storages(tensors) - self._done
        if not new:
            return new
        if len(self._done) + len(new) > self.KEPT:
            self._done.clear()
        populate(new)
        self._done |= new
        return new


def _storages(tensors: Iterable[torch.Tensor]) -> set[tuple[int, int]]:
    """(address, size) of each non-empty CPU storage under ``tensors``."""
    storages = (t.untyped_storage() for t in tensors if t.device.type == "cpu")
    return {(s.data_ptr(), s.nbytes()) for s in storages if s.nbytes() > 0}


def populate(storages: Iterable[tuple[int, int]]) -> None:
    """Have the kernel map every page of ``storages`` ((address, size) of memory a receiver
    mapped, such as a slot file) into this process, without reading them."""
    lib = libc()
    if lib is None:
        return
    page = mmap.PAGESIZE
    for start, size in storages:
        aligned = start - start % page
        lib.madvise(
            ctypes.c_void_p(aligned), ctypes.c_size_t(start + size - aligned), _MADV_POPULATE_READ
        )


def _take_fault(kind: str) -> dict[str, Any] | None:
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            fault = json.load(f)
    except (OSError, ValueError):
        return None
    if fault.get("fail") != kind:
        return None
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None  # taken by another worker of the server
    return dict(fault)


def _maybe_failing(
    pairs: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    fault = _take_fault("reload")
    if fault is None:
        return pairs
    time.sleep(float(fault.get("delay", 0.0)))  # a reload that takes its time
    return _fail_after(pairs, int(fault.get("after", 0)))


def _fail_after(
    pairs: Iterable[tuple[str, torch.Tensor]], after: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for i, pair in enumerate(pairs):
        if i == after:  # a reload under way: some layers are loaded, the rest are not
            raise RuntimeError(f"injected fault: the reload failed after {after} tensors")
        yield pair
