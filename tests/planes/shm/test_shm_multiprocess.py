"""SharedMemWeightSyncScheme with real spawned worker processes, real ZeroMQ and /dev/shm."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import pytest
import torch

import aiowsync
from _workers import (
    SPAWN,
    a_killed_sender,
    connect_all,
    digest,
    exact_bytes_then_no_mixed_reads,
    fixed_keys,
    make_model,
    on_version_1,
    randomize,
    send_past_a_stopped_worker,
    sender_main,
    waits_text,
    workers,
)
from helpers import eventually, fill

pytestmark = pytest.mark.timeout(240)

# Four workers, their reader threads and a trainer on two CPUs: beats may come late without
# anything being wrong. Tests about losing a worker set their own.
LOADED = aiowsync.Heartbeats(interval=0.5, missed=10)


async def test_subset_sends_and_worker_joining_from_address_alone() -> None:
    model = make_model("small")
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=LOADED)
    scheme.init_on_sender(model=model, num_workers=4)
    with workers() as w:
        async with scheme:
            for i in range(3):
                w.start(i, "small", scheme=scheme)
            w.start(3, "small", address=scheme.address)  # an unrelated process: address only
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
            await asyncio.to_thread(w.collect, "version", 1)

            randomize(model, 3)
            result = await scheme.send(timeout=20)
            assert result.worker_ids == (0, 1, 2, 3)
            seen = await asyncio.to_thread(w.collect, "version", 4)
            assert {e[2] for e in seen} == {3} and {e[3] for e in seen} == {digest(model)}


async def test_pull_mode_workers_apply_on_receive() -> None:
    model = make_model("small")
    scheme = aiowsync.SharedMemWeightSyncScheme(background=False, heartbeats=LOADED)
    scheme.init_on_sender(model=model, num_workers=2)
    with workers() as w:
        async with scheme:
            for i in range(2):
                w.start(i, "small", scheme=scheme)
            await connect_all(scheme, w, 2)
            for step in range(1, 4):
                randomize(model, step)
                result = await scheme.send(timeout=20)
                assert result.version == step
                seen = await asyncio.to_thread(w.collect, "version", 2)
                assert {e[3] for e in seen} == {digest(model)}


@pytest.mark.parametrize("kind", ["big", "many", "pair"])
async def test_exact_bytes_after_each_send_and_no_mixed_reads_back_to_back(kind: str) -> None:
    """ "pair": a policy and a value net in one scheme; a read that sees the two at different
    versions counts as mixed, and back-to-back sends last 8 s."""
    torch.manual_seed(0)
    model = make_model(kind)
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=LOADED)
    if kind == "pair":
        scheme.init_on_sender(models=dict(model.items()), num_workers=4)
    else:
        scheme.init_on_sender(model=model, num_workers=4)
    seconds = 8.0 if kind == "pair" else 6.0
    assert await exact_bytes_then_no_mixed_reads(scheme, model, kind, seconds=seconds) >= 10


@pytest.mark.parametrize("kind", ["many", "big"])
async def test_switches_made_by_the_waker_never_land_in_a_read(kind: str) -> None:
    """Workers without hooks switch where the update arrives: on their loop when it runs,
    from the receiver's waker thread while it waits for events. Each worker reads its model
    on its loop (pausing 1 ms between reads) and in a guarded thread, while the sender sends
    back to back (version k filled with k): no read sees two versions, and some switches
    were the waker's."""
    model = make_model(kind)
    fill(model, 0)
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=LOADED)
    scheme.init_on_sender(model=model, num_workers=3)
    with workers() as w:
        async with scheme:
            for i in range(3):
                w.start(
                    i, kind, scheme=scheme, tear=True, tear_from=0, hooks=False,
                    loop_pause=0.001, count_switchers=True, digests=False,
                )  # fmt: skip
            await connect_all(scheme, w, 3)
            deadline = time.monotonic() + 4.0
            version = 0
            while time.monotonic() < deadline or version < 20:
                version += 1
                fill(model, version)
                assert (await scheme.send(timeout=30)).version == version
            w.stop.set()
            done = await asyncio.to_thread(w.collect, "done", 3)
    for _, idx, stats in done:
        assert stats["loop_reads"] > 0 and stats["thread_reads"] > 0, stats
        assert stats["mixed"] == 0 and stats["wrong_version"] == 0, (idx, stats)
        assert stats["version"] == version
    assert sum(stats.get("waker_switches", 0) for _, _, stats in done) > 0, done


async def test_killed_worker_is_named_and_its_restart_rejoins_at_the_latest_version() -> None:
    scheme = aiowsync.SharedMemWeightSyncScheme()  # default beats: these tests lose a worker
    async with on_version_1(scheme, 3) as (model, w):
        w.kill(1)
        randomize(model, 2)
        started = time.monotonic()
        with pytest.raises(aiowsync.WeightSyncError) as info:
            # Either the loss is already known (raised at once) or the deadline names it.
            await scheme.send(timeout=scheme.heartbeats.timeout + 1.0)
        assert time.monotonic() - started < scheme.heartbeats.timeout + 10.0  # a busy host
        assert 1 in info.value.worker_ids  # type: ignore[attr-defined]
        assert info.value.acked == (0, 2)
        seen = await asyncio.to_thread(w.collect, "version", 2)
        assert {(e[1], e[2]) for e in seen} == {(0, 2), (2, 2)}

        # Once declared lost, a send naming it fails at once.
        sender = scheme._sender
        assert sender is not None
        await eventually(lambda: 1 in sender.lost_workers(), within=10)
        started = time.monotonic()
        with pytest.raises(aiowsync.WorkerLostError) as lost:
            await scheme.send(timeout=30)
        assert lost.value.worker_ids == (1,)
        assert time.monotonic() - started < 10.0  # at once, not after the 30 s deadline

        w.start(1, "small", scheme=scheme)
        await asyncio.to_thread(w.started, 1)  # its start-up counts for no deadline below
        rejoined = await asyncio.to_thread(w.collect, "ready", 1)
        assert rejoined[0][2] == 2 and rejoined[0][3] == digest(model)
        randomize(model, 3)
        result = await scheme.send(timeout=20)
        assert result.worker_ids == (0, 1, 2) and result.version == 3


async def test_receivers_keep_weights_and_report_disconnected_when_the_sender_dies() -> None:
    async with a_killed_sender("shm") as (scheme, model, pid):
        assert scheme.version == 0 and not scheme.ready
        # A wait for a newer version raises at once, naming the loss and the version kept.
        started = time.monotonic()
        with pytest.raises(aiowsync.SenderGoneError) as info:
            await scheme.wait_for_version(1, timeout=120)
        assert time.monotonic() - started < 60
        assert not info.value.closed and info.value.version == 0
        assert str(info.value).startswith("the sender was lost (no connection to ")
        assert str(info.value).endswith("); worker 0 keeps version 0")
        assert all(bool((t == 7).all()) for t in model.state_dict().values())
    # The dead sender's slot files are removed by the next sender to start.
    next_sender = aiowsync.SharedMemWeightSyncScheme()
    next_sender.init_on_sender(model=make_model("small"), num_workers=1)
    async with next_sender:
        prefix = f"aiowsync-{pid}-"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_a_sender_restarted_on_the_same_address_is_not_taken_for_the_old_one(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer killed and started again on a fixed address: its workers' sockets reconnect
    by themselves, but the new sender has never heard of them. They must say they are
    disconnected (not run on as if connected to nobody), hear from the new sender that it
    does not know them, keep their weights, and be able to join the new sender by entering
    `async with` again."""
    caplog.set_level(logging.INFO, logger="aiowsync")
    if transport == "ipc":
        bind = f"ipc://@aiowsync-test-restart-{os.getpid()}-{time.monotonic_ns()}"
    else:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            bind = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    beats = aiowsync.Heartbeats(interval=0.2, missed=10)
    # On tcp both trainers serve with the same keys, as a restarted trainer must for its
    # workers to reach it (each would otherwise make keys of its own).
    fields, keys = fixed_keys() if transport == "tcp" else (None, None)
    channels = None if keys is None else aiowsync.ZmqChannelFactory(curve=keys)
    queue = SPAWN.Queue()

    def trainer(value: float) -> Any:
        args = (queue, "small", value, bind, "shm", (0.5, 10), fields)
        return SPAWN.Process(target=sender_main, args=args, daemon=True)

    procs = [trainer(7)]
    procs[0].start()
    try:
        address = await asyncio.to_thread(queue.get, True, 60)
        model = make_model("small")
        scheme = aiowsync.SharedMemWeightSyncScheme(
            address=address, heartbeats=beats, channels=channels
        )
        scheme.init_on_receiver(model=model, worker_idx=0)
        async with scheme:
            await scheme.connect(timeout=30)
            assert await asyncio.to_thread(queue.get, True, 30) == "connected"
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].join(10)
            assert await eventually(lambda: not scheme.connected, within=15)

            # A queue of its own: the killed sender may have died between writing "connected"
            # and releasing the queue's write lock, which would then block every later put.
            queue = SPAWN.Queue()
            procs.append(trainer(9))
            procs[1].start()
            assert await asyncio.to_thread(queue.get, True, 60) == address
            # The worker's socket reconnects within a fraction of a second; for three
            # heartbeat timeouts it must still not count as connected.
            seen_connected = 0
            for _ in range(120):
                seen_connected += scheme.connected
                await asyncio.sleep(0.05)
            assert seen_connected == 0
            told = [r for r in caplog.records if "never welcomed this session" in r.getMessage()]
            assert told, "the new sender did not tell the worker that it does not know it"
            assert scheme.version == 0
            assert all(bool((t == 7).all()) for t in model.state_dict().values())

        async with scheme:  # a new session: it says hello to the new sender
            await scheme.connect(timeout=30)
            assert await asyncio.to_thread(queue.get, True, 30) == "connected"
            assert scheme.connected and scheme.version == 0
            assert all(bool((t == 9).all()) for t in model.state_dict().values())
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


async def test_frozen_worker_is_not_waited_for_and_its_slot_is_never_rewritten() -> None:
    scheme = aiowsync.SharedMemWeightSyncScheme()  # default beats: these tests lose a worker
    async with on_version_1(scheme, 3) as (model, w):
        frozen = w.procs[2]
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            # Wait until the sender has given up on it (polled: a loaded machine may take
            # longer than the heartbeat timeout to notice).
            sender = scheme._sender
            assert sender is not None
            assert await eventually(lambda: 2 in sender.lost_workers(), within=30), (
                "the frozen worker was never declared lost"
            )
            randomize(model, 2)
            with pytest.raises(aiowsync.WorkerLostError) as info:
                await scheme.send(timeout=10)
            assert info.value.worker_ids == (2,)
            # Sends to the others go on; worker 2's slot (version 1) stays pinned because its
            # process is alive, so new slots are made instead of overwriting it.
            for step in (3, 4, 5):
                randomize(model, step)
                result = await scheme.send(worker_ids=[0, 1], timeout=10)
                assert result.version == step - 1  # the refused send used no version
            assert scheme._sender is not None
            assert len(scheme._sender.plane._tables[""]) >= 3  # type: ignore[attr-defined]
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        # Back in time: its beats revive it and it takes the latest version.
        assert await eventually(lambda: 2 not in sender.lost_workers(), within=10)
        randomize(model, 6)
        result = await scheme.send(timeout=20)
        assert result.worker_ids == (0, 1, 2) and result.version == 5
        events = await asyncio.to_thread(w.collect, "version", 2 * 4 + 1)
        last = {e[1]: e for e in events}
        assert {idx: (e[2], e[3]) for idx, e in last.items()} == dict.fromkeys(
            range(3), (5, digest(model))
        )


async def test_a_worker_stopped_before_a_send_holds_up_no_one() -> None:
    # Each worker maps the slot and switches on its own: a stopped one delays nobody (unlike
    # a star of gloo links, where the sender had to stop waiting on it). The send names it
    # once its beats are missed.
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=LOADED)
    async with on_version_1(scheme, 3) as (model, w):
        stopped = w.procs[2]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            randomize(model, 2)
            deadline = 30.0
            want = dict.fromkeys((0, 1), (2, digest(model)))
            waited, error, took = await send_past_a_stopped_worker(scheme, w, want, deadline)
            print(f"stopped worker: the others waited {waits_text(waited)}; {took:.2f} s in all")
            assert error.worker_ids == (2,) and error.acked == (0, 1)
            # Neither waited for the stopped worker to be found lost (that ended the send).
            assert max(waited.values()) < LOADED.timeout / 2, (waited, took)
        finally:
            os.kill(stopped.pid, signal.SIGCONT)


async def test_workers_closing_together_are_seen_leaving_not_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Workers that close at the same moment each say goodbye and go. The sender may find
    # their goodbyes queued behind one another and their sockets already gone; it must read
    # the goodbyes before a heartbeat to a vanished socket makes it call them lost.
    model = make_model("small")
    beats = aiowsync.Heartbeats(interval=0.1, missed=40)
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=beats)
    scheme.init_on_sender(model=model, num_workers=3)
    caplog.set_level(logging.INFO, logger="aiowsync.sender")
    with workers() as w:
        async with scheme:
            for i in range(3):
                w.start(i, "small", scheme=scheme)
            await connect_all(scheme, w, 3)
            w.stop.set()
            time.sleep(1.5)  # the loop blocked: the goodbyes queue up, the sockets go away
            done = await asyncio.to_thread(w.collect, "done", 3)
            assert sorted(e[1] for e in done) == [0, 1, 2]
            sender = scheme._sender
            assert sender is not None
            assert await eventually(lambda: sender.lost_workers() == {0, 1, 2}, within=10)
    said = [r.getMessage() for r in caplog.records if r.name == "aiowsync.sender"]
    assert [m for m in said if "lost" in m and "said goodbye" not in m] == []
    assert sum("said goodbye" in m for m in said) == 3


async def test_a_process_that_takes_a_dead_senders_address_cannot_update_its_workers() -> None:
    # Before: a process that bound the dead sender's freed address learned the session from
    # the workers' own beats and sent an update naming one of the dead sender's slots; the
    # worker switched to it, reported version 1000 and connected=True, and acked.
    import zmq

    from aiowsync._protocol import Heartbeat, Update, decode, encode

    async with a_killed_sender("shm") as (scheme, model, pid):
        stale = next(n for n in os.listdir("/dev/shm") if n.startswith(f"aiowsync-{pid}-"))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        impostor = ctx.socket(zmq.ROUTER)
        impostor.setsockopt(zmq.LINGER, 0)
        try:
            impostor.bind(scheme.address)
            # The worker's sockets reconnect by themselves; their beats tell the session.
            seen: dict[bytes, str] = {}
            deadline = time.monotonic() + 30
            while len(seen) < 2 and time.monotonic() < deadline:
                if await asyncio.to_thread(impostor.poll, 200):
                    routing, frame = impostor.recv_multipart()
                    message = decode(frame)
                    if isinstance(message, Heartbeat):
                        seen[routing] = message.session
            assert seen, "the worker never reconnected to the impostor"
            session = next(iter(seen.values()))
            nbytes = os.stat(f"/dev/shm/{stale}").st_size
            for routing in seen:  # its main socket and its beat socket: one of them reads
                for forged in (
                    Heartbeat(worker_idx=-1, session=session, version=1000),
                    Update(version=1000, params={"path": f"/dev/shm/{stale}", "nbytes": nbytes}),
                ):
                    impostor.send_multipart([routing, encode(forged)])
            assert await eventually(lambda: scheme.dropped_messages >= 1, within=20)
            # Refused and counted: the worker keeps its version and its bytes, says it is not
            # connected, and answers nothing.
            assert scheme.version == 0 and not scheme.connected
            assert all(bool((t == 7).all()) for t in model.state_dict().values())
            answers = []
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                if await asyncio.to_thread(impostor.poll, 100):
                    answers.append(decode(impostor.recv_multipart()[1]))
            assert not [a for a in answers if not isinstance(a, Heartbeat)], answers
            with pytest.raises(aiowsync.SenderGoneError, match="did not come from the sender"):
                await scheme.wait_for_version(1, timeout=5)
        finally:
            impostor.close()
            ctx.term()
