"""aiowsync's side of a benchmark cell: one scheme (``shm`` or ``dist``) whose receivers are the
:class:`~aiowsync._tools.bench._pool.WorkerPool`'s processes, and its send modes as contenders."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import torch

from aiowsync import (
    DistributedWeightSyncScheme,
    Heartbeats,
    SharedMemWeightSyncScheme,
    ZmqChannelFactory,
)

from ._checks import INTEGRITY_MODE
from ._contenders import Contender
from ._models import SendSources, Spec, build_model, fill, fingerprint, random_init, spec_bytes
from ._pool import WorkerPool

__all__ = ["AiowsyncSend", "AiowsyncSession"]


class AiowsyncSession:
    """One aiowsync scheme (``shm`` or ``dist``) with the pool's first ``n`` workers joined.

    Both modes share the session: ``send()`` sends the model given at ``init_on_sender``;
    ``send(weights)`` sends a ``TensorDict`` clone of it, filled separately. ``rehome``: the
    sender's model is re-homed (its tensors become views of one flat buffer);
    ``bucket_bytes``: the distributed scheme's bucket size (its default when None);
    ``variant``: the distributed scheme's topology and its control channel's authentication
    (``"curve"``, the default, or ``"off"``); (star, curve) when None. ``profile``: what the
    workers do beside receiving (``"light"`` or ``"policy"``, see
    :class:`~aiowsync._tools.bench._worker.PolicyReads`).
    """

    def __init__(
        self,
        transport: str,
        pool: WorkerPool,
        spec: Spec,
        n: int,
        timeout: float,
        wire_dtype: str | None = None,
        *,
        rehome: bool = False,
        bucket_bytes: int | None = None,
        variant: tuple[str, str] | None = None,
        profile: str = "light",
    ):
        self.transport = transport
        self.wire = getattr(torch, wire_dtype) if wire_dtype else None
        self.pool = pool
        self.spec = spec
        self.ids = list(range(n))
        self.timeout = timeout
        self.profile = profile
        torch.manual_seed(0)
        self.sources = SendSources(build_model(spec, random_init))
        self.k = 0
        self.totals: list[float] = []
        """Whole ``publish()`` sends, acks included (seconds)."""
        beats = Heartbeats(interval=0.5, missed=10)  # busy 2-core machine: slow beats are normal
        self.scheme: SharedMemWeightSyncScheme | DistributedWeightSyncScheme
        # Integrity as the transport's default: the other setting is a mode of its own
        # (:data:`INTEGRITY_MODE`), measured on the same session, turn about.
        if transport == "shm":
            self.scheme = SharedMemWeightSyncScheme(heartbeats=beats, wire_dtype=self.wire)
        else:
            # The scheme's own defaults unless others were asked for.
            extra: dict[str, Any] = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
            topology, auth = variant or ("star", "curve")
            if auth == "off":
                extra["channels"] = ZmqChannelFactory(allow_insecure_bind=True)
            self.scheme = DistributedWeightSyncScheme(
                backend="gloo",
                heartbeats=beats,
                wire_dtype=self.wire,
                topology=topology,  # type: ignore[arg-type]
                **extra,
            )
        self.scheme.init_on_sender(model=self.sources.module, num_workers=n, rehome=rehome)
        self._joined = False
        self._entered = False
        self._integrity: bool | None = None

    async def open(self) -> None:
        await self.scheme.__aenter__()
        self._entered = True
        self._integrity = bool(self.scheme._sender.digests.enabled)
        for i in self.ids:  # after entering: the address the scheme carries is bound
            self.pool.tell(i, ("join", self.scheme, self.spec, self.profile))
        self._joined = True
        await self.scheme.connect(timeout=self.timeout)
        for i in self.ids:
            await self.pool.expect(i, "ready", timeout=self.timeout)

    def integrity(self, mode: str) -> bool:
        """Whether the sends of ``mode`` carry digests (known once the session is open)."""
        if self._integrity is None:
            raise RuntimeError("the session is not open")
        return self._integrity != (mode == INTEGRITY_MODE[self.transport])

    def fill_next(self, mode: str) -> None:
        self.k += 1
        fill(self.sources.targets("send(weights)" if mode == "send(weights)" else "send()"), self.k)

    async def send(self, mode: str) -> float:
        """One send in ``mode``; its time. For ``publish()``, the time the trainer is held
        (until ``publish()`` returns): the trainer then writes its weights at once, as its
        next step would, and the acks are awaited after (their wait is in ``totals``)."""
        t0 = time.perf_counter()
        if mode == "send()":
            await self.scheme.send(timeout=self.timeout)
        elif mode == INTEGRITY_MODE[self.transport]:
            digests = self.scheme._sender.digests
            digests.enabled = self.integrity(mode)
            try:
                await self.scheme.send(timeout=self.timeout)
            finally:
                digests.enabled = self._integrity
        elif mode == "publish()":
            pending = await self.scheme.publish(timeout=self.timeout)
            held = time.perf_counter() - t0
            # Written while the version is on its way: a worker that read any of it would
            # hold a mix of two values, which the tear readers count.
            # In a thread, as a trainer's step would not run on its loop either.
            await asyncio.to_thread(fill, self.sources.targets("send()"), -self.k)
            await pending
            self.totals.append(time.perf_counter() - t0)
            return held
        else:
            await self.scheme.send(self.sources.weights, timeout=self.timeout)
        return time.perf_counter() - t0

    async def verify(self) -> None:
        """Every worker holds exactly the sender's model at a new version."""
        self.fill_next("send()")
        await self.send("send()")
        expected = fingerprint(self.sources.module)
        if self.wire is not None:  # floats arrive through the wire dtype
            floats = {
                k for k, t in self.sources.module.state_dict().items() if t.is_floating_point()
            }
            expected = [
                (k, _through(a, self.wire), _through(b, self.wire)) if k in floats else (k, a, b)
                for k, a, b in expected
            ]
        version = self.scheme.version
        checks = await self.pool.ask(self.ids, ("check", version), "check", self.timeout)
        bad = [i for i, c in zip(self.ids, checks, strict=True) if c[2] != expected]
        if bad:
            raise AssertionError(f"aiowsync {self.transport}: workers {bad} do not hold v{version}")

    async def policy_reads(self) -> list[dict[str, Any]] | None:
        """Per worker, what the policy profile's reads did (None under the light profile)."""
        if self.profile != "policy":
            return None
        return [m[1] for m in await self.pool.ask(self.ids, ("policy",), "policy", self.timeout)]

    async def memory(self) -> list[dict[str, Any]]:
        """Each worker's private memory beyond what it held before it built its model (KiB
        counted without the slot files it maps), as a fraction of the model's bytes; also after
        glibc's ``malloc_trim(0)``, and what the module's objects alone cost."""
        nbytes = spec_bytes(self.spec)
        out = []
        for _, baseline, before, after, _, version, meta_kb in await self.pool.ask(
            self.ids, ("mem",), "mem", self.timeout
        ):
            grown = (before["own_kb"] - baseline["own_kb"]) * 1024
            trimmed = (after["own_kb"] - baseline["own_kb"]) * 1024
            out.append(
                {
                    "version": version,
                    "own_growth_bytes": grown,
                    "fraction_of_model": grown / nbytes,
                    "fraction_after_trim": trimmed / nbytes,
                    "module_objects_bytes": meta_kb * 1024,
                }
            )
        return out

    async def close(self) -> None:
        try:
            if self._joined:
                await self.pool.leave(self.ids, self.timeout)
        finally:
            if self._entered:
                await self.scheme.__aexit__(None, None, None)
            del self.sources
            gc.collect()


def _through(value: float, dtype: torch.dtype) -> float:
    """``value`` after a trip through ``dtype``."""
    return float(torch.tensor(value).to(dtype).float())


class AiowsyncSend(Contender):
    kind = "aiowsync"

    def __init__(self, session: AiowsyncSession, mode: str) -> None:
        super().__init__(f"aiowsync {session.transport} {mode}", session.transport)
        self.session = session
        self.mode = mode
        self.pool, self.ids, self.timeout = session.pool, session.ids, session.timeout

    def prepare(self) -> None:
        self.session.fill_next(self.mode)

    async def timed(self) -> float:
        return await self.session.send(self.mode)

    async def measure_tear(self, sends: int, max_s: float) -> None:
        s = self.session
        await s.pool.ask(s.ids, ("read_start",), "ok", s.timeout)
        until = time.monotonic() + max_s
        done = 0
        try:
            await asyncio.sleep(0.1)
            while done < sends and (done == 0 or time.monotonic() < until):
                s.fill_next(self.mode)
                await s.send(self.mode)
                done += 1
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        finally:
            stats = await s.pool.ask(s.ids, ("read_stop",), "reads", s.timeout)
        where = ("loop", "guarded thread")
        self.tear = {
            "reads": [dict(zip(where, r[1], strict=True)) for r in stats],
            "mixed": [dict(zip(where, r[2], strict=True)) for r in stats],
            "sends": done,
        }
