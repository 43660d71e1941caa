"""DistributedWeightSyncScheme on gloo with real spawned receivers, real ZeroMQ and real groups."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import aiowsync
from _workers import (
    Workers,
    a_killed_sender,
    connect_all,
    digest,
    exact_bytes_then_no_mixed_reads,
    make_model,
    on_version_1,
    randomize,
    send_past_a_stopped_worker,
    waits_text,
    workers,
)
from helpers import eventually

pytestmark = pytest.mark.timeout(240)

# Small buckets, so that every model here spans several and tensors straddle bucket edges.
BUCKETS = {"big": 4 << 20, "many": 256 << 10, "small": 8 << 10, "pair": 4 << 20}


def scheme_for(kind: str, **kw: Any) -> aiowsync.DistributedWeightSyncScheme:
    return aiowsync.DistributedWeightSyncScheme(backend="gloo", bucket_bytes=BUCKETS[kind], **kw)


async def test_subsets_pull_mode_and_a_receiver_joining_from_the_address_alone() -> None:
    model = make_model("small")
    scheme = scheme_for("small", background=False)
    scheme.init_on_sender(model=model, num_workers=4)
    with workers() as w:
        async with scheme:
            for i in range(3):
                w.start(i, "small", scheme=scheme)
            # An unrelated process: the address, the same constructor arguments, and the
            # keys of the sender's tcp socket (no server secret), as its user would hand them.
            keys = scheme.channels.curve.for_receiver()  # type: ignore[attr-defined]
            w.start(
                3, "small", address=scheme.address, transport="gloo", background=False, keys=keys
            )
            await connect_all(scheme, w, 4)

            randomize(model, 1)
            result = await scheme.send(worker_ids=[0, 2], timeout=20)
            assert (result.version, result.worker_ids) == (1, (0, 2))
            seen = await asyncio.to_thread(w.collect, "version", 2)
            assert sorted((e[1], e[2]) for e in seen) == [(0, 1), (2, 1)]
            assert all(e[3] == digest(model) for e in seen)

            randomize(model, 2)
            result = await scheme.send(worker_ids=3, timeout=20)
            assert (result.version, result.worker_ids) == (2, (3,))
            seen = await asyncio.to_thread(w.collect, "version", 1)
            assert seen[0][1:] == (3, 2, digest(model))

            randomize(model, 3)
            result = await scheme.send(timeout=20)
            assert result.worker_ids == (0, 1, 2, 3)
            seen = await asyncio.to_thread(w.collect, "version", 4)
            assert {e[2] for e in seen} == {3} and {e[3] for e in seen} == {digest(model)}


@pytest.mark.parametrize("kind", ["big", "many", "pair"])
async def test_exact_bytes_after_each_send_and_no_mixed_reads_back_to_back(kind: str) -> None:
    """ "pair": a policy and a value net in one scheme; a read that sees the two at different
    versions counts as mixed, and back-to-back sends last 8 s."""
    torch.manual_seed(0)
    model = make_model(kind)
    scheme = scheme_for(kind)
    if kind == "pair":
        scheme.init_on_sender(models=dict(model.items()), num_workers=4)
    else:
        scheme.init_on_sender(model=model, num_workers=4)
    seconds = 8.0 if kind == "pair" else 6.0
    assert await exact_bytes_then_no_mixed_reads(scheme, model, kind, seconds=seconds) >= 10


@contextlib.asynccontextmanager
async def _four_receivers_on_version_1(
    **kw: Any,
) -> AsyncIterator[tuple[aiowsync.DistributedWeightSyncScheme, torch.nn.Module, Workers]]:
    scheme = scheme_for("small", **kw)
    async with on_version_1(scheme, 4) as (model, w):
        yield scheme, model, w


async def test_killed_receiver_is_named_by_the_timeout_the_others_commit_and_it_rejoins() -> None:
    # Beats slower than the send's deadline, so that the deadline (not the beats) finds it.
    slow_beats = aiowsync.Heartbeats(interval=1.0, missed=15)
    async with _four_receivers_on_version_1(heartbeats=slow_beats) as (scheme, model, w):
        w.kill(1)
        randomize(model, 2)
        deadline = 8.0
        started = time.monotonic()
        with pytest.raises(aiowsync.WeightSyncTimeout) as info:
            await scheme.send(timeout=deadline)
        assert time.monotonic() - started < deadline + 5.0
        assert info.value.worker_ids == (1,)
        assert info.value.version == 2 and info.value.acked == (0, 2, 3)
        seen = await asyncio.to_thread(w.collect, "version", 3)
        assert {(e[1], e[2]) for e in seen} == {(0, 2), (2, 2), (3, 2)}
        assert {e[3] for e in seen} == {digest(model)}

        # A restart under the same index rejoins holding the latest version.
        w.start(1, "small", scheme=scheme)
        await asyncio.to_thread(w.started, 1)  # its start-up counts for no deadline below
        rejoined = await asyncio.to_thread(w.collect, "ready", 1)
        assert rejoined[0][1:] == (1, 2, digest(model))

        # And the next send reaches everyone, on a group formed with the new process.
        randomize(model, 3)
        result = await scheme.send(timeout=20)
        assert result.worker_ids == (0, 1, 2, 3) and result.version == 3
        seen = await asyncio.to_thread(w.collect, "version", 4)
        assert {(e[2], e[3]) for e in seen} == {(3, digest(model))}


async def _latest(w: Workers, want: dict[int, tuple[int, str]], within: float = 60) -> None:
    """Read version reports until each worker's latest is ``want[worker]`` (version, digest)."""
    latest: dict[int, tuple[int, str]] = {}
    deadline = time.monotonic() + within
    while any(latest.get(k) != v for k, v in want.items()):
        assert time.monotonic() < deadline, f"reported {latest}, wanted {want}"
        event = (await asyncio.to_thread(w.collect, "version", 1, deadline - time.monotonic()))[0]
        latest[event[1]] = (event[2], event[3])


async def test_a_stopped_star_member_holds_up_no_one_is_named_and_comes_back_with_the_latest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Worker 1 is stopped (SIGSTOP) before the send: its connections stay open, so the
    # sender's sends to it never complete and nothing fails on its own. The sender gives up on
    # its link after the stall limit (seconds, far below the deadline), which breaks the
    # group: the others' receives fail, and they are sent the version again on a fresh group
    # within the same send. The send names worker 1, lost by its beats. (Before, the sender
    # waited on worker 1 until the deadline with the others' later buckets unsent: no worker
    # got the version.)
    caplog.set_level(logging.WARNING, logger="aiowsync.dist")
    beats = aiowsync.Heartbeats(interval=0.25, missed=8)  # silent for 2 s: lost
    async with _four_receivers_on_version_1(heartbeats=beats) as (scheme, model, w):
        stalled = w.procs[1]
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            randomize(model, 2)
            deadline = 20.0  # the stall limit (5 s), then a retry: room for a busy host
            want = dict.fromkeys((0, 2, 3), (2, digest(model)))
            waited, error, took = await send_past_a_stopped_worker(scheme, w, want, deadline)
            print(f"stopped star member: the others waited {waits_text(waited)}; {error}")
            # Every other member answered within the send, before its deadline.
            assert error.worker_ids == (1,) and error.version == 2
            assert error.acked == (0, 2, 3) and took < deadline, took
            assert any(
                "worker 1: nothing moved on the link to worker 1 for" in r.getMessage()
                for r in caplog.records
            ), [r.getMessage() for r in caplog.records]
            sender = scheme._sender
            assert sender is not None
            assert await eventually(lambda: 1 in sender.lost_workers(), within=30)
            started = time.monotonic()
            with pytest.raises(aiowsync.WorkerLostError) as lost:
                await scheme.send(timeout=30)
            assert lost.value.worker_ids == (1,) and time.monotonic() - started < 10
            randomize(model, 3)
            result = await scheme.send(worker_ids=[0, 2, 3], timeout=20)
            assert result.version == 3  # the refused send used no version
            await _latest(w, {i: (3, digest(model)) for i in (0, 2, 3)})
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        assert await eventually(lambda: 1 not in sender.lost_workers(), within=30)
        randomize(model, 4)
        result = await scheme.send(timeout=30)
        assert result.worker_ids == (0, 1, 2, 3) and result.version == 4
        await _latest(w, dict.fromkeys(range(4), (4, digest(model))))


async def test_receivers_keep_their_weights_when_the_distributed_sender_dies() -> None:
    async with a_killed_sender("dist", background=False) as (r, model, _):
        assert not r.ready and r.version == 0
        # The loss is an event: both ways of waiting for a newer version say so at once.
        with pytest.raises(aiowsync.SenderGoneError, match="keeps version 0") as pulled:
            await r.receive(timeout=60)
        assert not pulled.value.closed
        with pytest.raises(aiowsync.SenderGoneError, match=r"^the sender was lost"):
            await r.wait_for_version(1, timeout=60)
        assert all(bool((t == 7).all()) for t in model.state_dict().values())


async def test_a_receiver_killed_mid_chain_leaves_no_survivor_on_a_mix() -> None:
    # A chain of four receivers; the second is SIGKILLed while the version travels along it.
    # The send either completes for the others or fails naming it; every survivor runs the
    # version before or the new one, with its exact bytes; the next send reaches them all.
    beats = aiowsync.Heartbeats(interval=0.2, missed=10)
    scheme = aiowsync.DistributedWeightSyncScheme(
        backend="gloo", bucket_bytes=16 << 10, topology="chain", heartbeats=beats
    )
    async with on_version_1(scheme, 4, kind="big") as (model, w):
        before = digest(model)
        randomize(model, 2)
        after = digest(model)
        deadline = 20.0
        started = time.monotonic()
        send = asyncio.create_task(scheme.send(timeout=deadline))
        await asyncio.sleep(0.05)
        w.kill(1)
        try:
            result = await send
            outcome = f"completed for {result.worker_ids}"
        except aiowsync.WeightSyncError as exc:
            assert 1 in getattr(exc, "worker_ids", ()), repr(exc)
            outcome = f"failed naming worker 1 ({type(exc).__name__}), acked {exc.acked}"
        took = time.monotonic() - started
        assert took < deadline + beats.timeout, took
        # Each survivor's latest report: the version before or the new one, exact either way.
        await asyncio.sleep(1.0)
        latest: dict[int, tuple[int, str]] = {}
        for event in [*w.other, *iter_events(w)]:
            if event[0] == "version" and event[2] >= 1:  # earlier reports were set aside
                latest[event[1]] = (event[2], event[3])
        for worker in (0, 2, 3):
            version, got = latest.get(worker, (1, before))
            assert (version, got) in {(1, before), (2, after)}, (worker, version)
        print(f"mid-chain kill: {outcome} in {took:.2f} s; survivors {latest}")
        randomize(model, 3)
        result = await scheme.send(worker_ids=[0, 2, 3], timeout=30)
        assert result.worker_ids == (0, 2, 3)
        await _latest(w, {k: (3, digest(model)) for k in (0, 2, 3)})


async def test_a_chain_member_process_that_damages_what_it_forwards_is_routed_around() -> None:
    # N2 across processes, with the scheme's defaults (digests on, the chain's own buckets):
    # worker 1 holds the right bytes but forwards damaged ones. Workers 2 and 3 refuse them
    # against the trainer's digest, which followed the bytes; they are sent the version again
    # within the same send on a chain without worker 1, which is named; the next chain puts
    # it last, where it forwards to nobody.
    scheme = aiowsync.DistributedWeightSyncScheme(
        topology="chain", heartbeats=aiowsync.Heartbeats(interval=0.2, missed=10)
    )
    model = make_model("big")
    scheme.init_on_sender(model=model, num_workers=4)
    with workers() as w:
        async with scheme:
            for i in range(4):
                w.start(i, "big", scheme=scheme, damages_forwards=i == 1)
            await connect_all(scheme, w, 4)
            randomize(model, 1)
            result = await scheme.send(timeout=60)
            assert result.suspects == (1,) and result.retried == (2, 3), result
            await _latest(w, dict.fromkeys(range(4), (1, digest(model))))  # exact bytes
            randomize(model, 2)
            later = await scheme.send(timeout=60)
            assert later.retries == 0 and later.suspects == (), later
            await _latest(w, dict.fromkeys(range(4), (2, digest(model))))
            print(
                f"damaging member process: {result.seconds:.2f} s, the next {later.seconds:.2f} s"
            )


async def test_a_chain_member_stopped_before_the_version_reached_it_is_named_the_rest_get_it(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    # Worker 1 is stopped (SIGSTOP) before the send: its connections stay open, so nothing
    # fails on its own, and the members after it wait on a link that moves nothing. They give
    # up on it after the chain's stall limit (seconds, far below the deadline) and are sent
    # the version again on a chain without it; the send names worker 1, lost by its beats.
    caplog.set_level(logging.WARNING, logger="aiowsync.sender")
    beats = aiowsync.Heartbeats(interval=0.2, missed=10)
    scheme = aiowsync.DistributedWeightSyncScheme(
        backend="gloo", bucket_bytes=16 << 10, topology="chain", heartbeats=beats
    )
    async with on_version_1(scheme, 4, kind="big") as (model, w):
        stopped = w.procs[1]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            randomize(model, 2)
            started = time.monotonic()
            with pytest.raises(aiowsync.LostDuringSendError) as info:
                await scheme.send(timeout=90)
            took = time.monotonic() - started
            # Every other member answered before the deadline, and runs the new version.
            assert info.value.worker_ids == (1,) and info.value.acked == (0, 2, 3)
            await _latest(w, {k: (2, digest(model)) for k in (0, 2, 3)})
            print(f"stopped chain member: {info.value} in {took:.2f} s")
            # Worker 2 gave up on the link from the stopped worker 1 and said so: a member
            # names the member before it (on the first chain 0-1-2-3, or the sender on the
            # retry's chain 2-3), never the one after.
            stalls = _stalled_links(caplog.records, version=2)
            assert stalls.get(2) == ["worker 1"], stalls
            before = {2: {"worker 1", "the sender"}, 3: {"worker 2"}}
            assert all(set(named) <= before[k] for k, named in stalls.items()), stalls
            # Worker 0, whose forward to worker 1 stalled, names the member after it: worker 0
            # holds the version and acked, so only its own log (its stderr) says so.
            logged = capfd.readouterr().err
            forward = "worker 0: forwarding to the next member failed: nothing moved on the link"
            assert f"{forward} to worker 1 for " in logged, logged[-3000:]
            randomize(model, 3)
            result = await scheme.send(worker_ids=[0, 2, 3], timeout=30)
            assert result.worker_ids == (0, 2, 3)
            await _latest(w, {k: (3, digest(model)) for k in (0, 2, 3)})
        finally:
            w.kill(1)  # a stopped process takes SIGKILL too


_STALLED = re.compile(r"nothing moved on the link to (the sender|worker \d+) for ")


def _stalled_links(records: list[logging.LogRecord], version: int) -> dict[int, list[str]]:
    """For each worker whose answer to ``version`` (as the sender logged it) said a link
    stalled, the peers those answers named."""
    named: dict[int, list[str]] = {}
    for record in records:
        if record.name != "aiowsync.sender" or not record.msg.startswith("worker %d could not"):
            continue
        worker, answered, text = record.args  # type: ignore[misc]
        if answered == version and (found := _STALLED.search(text)):
            named.setdefault(worker, []).append(found.group(1))
    return named


def iter_events(w: Workers) -> list[tuple[Any, ...]]:
    """Every event already queued, without waiting."""
    import queue

    out = []
    while True:
        try:
            out.append(w.events.get_nowait())
        except queue.Empty:
            return out
