"""What several test files share: small models, their comparison, schemes wired up in this
process, polling, and running the command line. Plain functions; fixtures live in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch
from torch import nn

import aiowsync

S = TypeVar("S", bound=aiowsync.WeightSyncScheme)

# Beats every 0.1 s; a loss takes 5 s of silence, which no test using these beats waits for.
BEATS = aiowsync.Heartbeats(interval=0.1, missed=50)


def model(seed: int = 0, *, big: bool = False) -> nn.Module:
    """A small model, staged on the loop; ``big`` adds 4 MiB, so that it is staged in a thread
    and gathered tensor by tensor."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if big:
        m.append(nn.Linear(1024, 1024))
    return m


def same(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models hold the same keys with equal tensors."""
    sa, sb = a.state_dict(), b.state_dict()
    # On the CPU: torch.equal refuses tensors of two devices (a CUDA receiver's, say).
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def bump(m: nn.Module, by: float = 1.0) -> None:
    """Make a new version: add ``by`` to every parameter and one to every integer buffer."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(by)
        for b in m.buffers():
            if not b.is_floating_point() and b.dtype != torch.bool:
                b.add_(1)


@contextlib.asynccontextmanager
async def system(
    scheme: Callable[..., S],
    n: int = 2,
    *,
    make_model: Callable[[int], nn.Module] = model,
    connect_timeout: float = 10,
    **sender_kw: Any,
) -> AsyncIterator[tuple[S, nn.Module, list[tuple[S, nn.Module]]]]:
    """A sender of ``make_model(0)`` built by ``scheme(**sender_kw)`` and ``n`` connected
    receivers in this process, each a pickled copy into ``make_model(100 + i)``:
    (sender, its model, [(receiver, its model)])."""
    src = make_model(0)
    sender = scheme(**sender_kw)
    sender.init_on_sender(model=src, num_workers=n)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(sender)
        receivers: list[tuple[S, nn.Module]] = []
        for i in range(n):
            r = pickle.loads(pickle.dumps(sender))
            m = make_model(100 + i)
            r.init_on_receiver(model=m, worker_idx=i)
            await stack.enter_async_context(r)
            receivers.append((r, m))
        await asyncio.gather(
            sender.connect(timeout=connect_timeout),
            *(r.connect(timeout=connect_timeout) for r, _ in receivers),
        )
        yield sender, src, receivers


@contextlib.asynccontextmanager
async def pair(
    src: Any,
    mirror: Any,
    *,
    rehome: bool = False,
    heartbeats: aiowsync.Heartbeats = BEATS,
    connect_timeout: float = 20,
    **receiver_kw: Any,
) -> AsyncIterator[tuple[aiowsync.SharedMemWeightSyncScheme, aiowsync.SharedMemWeightSyncScheme]]:
    """A shared-memory sender of ``src`` and one connected receiver into ``mirror``, built from
    the sender's address alone: (sender, receiver)."""
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=heartbeats)
    sender.init_on_sender(model=src, num_workers=1, rehome=rehome)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, **receiver_kw)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(
                sender.connect(timeout=connect_timeout), r.connect(timeout=connect_timeout)
            )
            yield sender, r


def rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def eventually(predicate: Callable[[], bool], within: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds, for at most ``within`` seconds; its last answer."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m aiowsync ARGS`` in a child process, its output captured as text."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, "-m", "aiowsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
