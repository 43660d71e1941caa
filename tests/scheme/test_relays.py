"""Relays (issue 30): a receiver that forwards each version to leaves of its own, under the
root's version numbers, and acknowledges only once they hold it."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
from torch import nn

import aiowsync
from helpers import bump, model, same

pytestmark = pytest.mark.timeout(120)

BEATS = aiowsync.Heartbeats(interval=0.1, missed=20)
TIMEOUTS = aiowsync.Timeouts(handshake=20, ack=10, transfer=20)


def _memory(channels: aiowsync.MemoryChannelFactory, **kw: Any) -> aiowsync.WeightSyncScheme:
    return aiowsync.WeightSyncScheme(
        plane=aiowsync.MemoryPlane(), channels=channels, heartbeats=BEATS, timeouts=TIMEOUTS, **kw
    )


class Tree:
    """A root sender, one relay (an upstream receiver and a local sender on one model) and
    its leaves, all in this process on the in-process plane (the relay's local scheme on
    torch.distributed with ``local="dist"``)."""

    def __init__(
        self,
        leaves: int = 2,
        *,
        before_relay: Callable[[int], None] | None = None,
        local: str = "memory",
        **root: Any,
    ) -> None:
        self.src = model(0)
        self.root = _memory(aiowsync.MemoryChannelFactory(), **root)
        self.root.init_on_sender(model=self.src, num_workers=1)
        self.relay_model = model(1)
        self.upstream = pickle.loads(pickle.dumps(self.root))
        self.upstream.init_on_receiver(model=self.relay_model, worker_idx=0)
        if before_relay is not None:  # a hook of the upstream's that runs before the relay's
            self.upstream.register_hook(before_relay)
        if local == "dist":
            self.local = aiowsync.DistributedWeightSyncScheme(heartbeats=BEATS, timeouts=TIMEOUTS)
        else:
            self.local = _memory(aiowsync.MemoryChannelFactory())
        self.local.init_on_sender(model=self.relay_model, num_workers=leaves)
        self.upstream.relay_to(self.local)
        self.leaf_models = [model(10 + i) for i in range(leaves)]
        self.leaves: list[aiowsync.WeightSyncScheme | None] = [None] * leaves
        self.stack = contextlib.AsyncExitStack()
        self.leaf_stacks: list[contextlib.AsyncExitStack | None] = [None] * leaves

    async def start_leaf(self, i: int) -> aiowsync.WeightSyncScheme:
        leaf = pickle.loads(pickle.dumps(self.local))
        leaf.init_on_receiver(model=self.leaf_models[i], worker_idx=i)
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(leaf)
        self.leaves[i], self.leaf_stacks[i] = leaf, stack
        return leaf

    async def stop_leaf(self, i: int) -> None:
        stack = self.leaf_stacks[i]
        assert stack is not None
        await stack.aclose()
        self.leaves[i] = self.leaf_stacks[i] = None

    async def connect(self) -> None:
        """Connect the root, both sides of the relay and the leaves started (all entered)."""
        await asyncio.gather(
            self.root.connect(timeout=20),
            self.upstream.connect(timeout=20),
            self.local.connect(timeout=20),
            *(leaf.connect(timeout=20) for leaf in self.leaves if leaf is not None),
        )

    def leaves_hold(self, version: int) -> bool:
        return all(
            leaf is not None and leaf.version == version and same(m, self.src)
            for leaf, m in zip(self.leaves, self.leaf_models, strict=True)
        )


@contextlib.asynccontextmanager
async def tree(leaves: int = 2, *, local_first: bool = True, **kw: Any) -> AsyncIterator[Tree]:
    t = Tree(leaves, **kw)
    async with t.stack:
        await t.stack.enter_async_context(t.root)
        order = [t.local, t.upstream] if local_first else [t.upstream, t.local]
        for scheme in order:
            await t.stack.enter_async_context(scheme)
        for i in range(leaves):
            await t.start_leaf(i)
        await t.connect()
        try:
            yield t
        finally:
            for i in reversed(range(leaves)):  # schemes leave in the reverse order
                if t.leaf_stacks[i] is not None:
                    await t.stop_leaf(i)


@pytest.mark.parametrize("local_first", [True, False])
async def test_every_leaf_runs_each_root_version_when_the_roots_send_returns(
    local_first: bool,
) -> None:
    async with tree(local_first=local_first) as t:
        # Version 0 is the root's, bytes and number, whichever scheme was entered first.
        assert t.local.version == 0 and t.leaves_hold(0)
        for _ in range(10):
            bump(t.src)
            result = await t.root.send(timeout=20)
            assert result.worker_ids == (0,) and result.retries == 0
            assert t.leaves_hold(result.version), result.version
        assert t.local.version == t.root.version == 10


@pytest.mark.parametrize("local", ["memory", "dist"])
async def test_leaves_check_the_roots_digest_so_a_relay_that_damages_its_copy_fails(
    local: str,
) -> None:
    # N3. Before: the relay's sender digested its own copy, so bytes the relay damaged after
    # its upstream had checked them (a flipped bit, a bug; here a hook that runs before the
    # relay's) reached the leaves under a digest of the damage, passed their check, and the
    # root's send() succeeded. Now the leaves check the root's digest: carried in the update
    # (memory), or following the bytes under the relay's seal (dist).
    damage = {"on": False}

    def flip(version: int) -> None:
        if damage["on"]:
            with torch.no_grad():
                next(t.relay_model.parameters()).view(-1)[3] += 1.0

    async with tree(before_relay=flip, local=local, integrity=True, apply_mode="copy") as t:
        bump(t.src)
        assert (await t.root.send(timeout=20)).worker_ids == (0,) and t.leaves_hold(1)
        kept = [{k: v.clone() for k, v in m.state_dict().items()} for m in t.leaf_models]
        damage["on"] = True
        bump(t.src)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await t.root.send(timeout=20)
        error = info.value.errors[0]
        relay = "WeightSyncError: relay (worker 0): leaves [0, 1] do not hold version 2"
        assert error.startswith(relay), error
        assert error.count("DigestMismatch: bucket 0 of 1") == 2, error
        for leaf, m, before in zip(t.leaves, t.leaf_models, kept, strict=True):
            assert leaf is not None and leaf.version == 1  # the version before, exactly
            assert same(m, before)
        damage["on"] = False
        bump(t.src)
        assert (await t.root.send(timeout=20)).worker_ids == (0,) and t.leaves_hold(3)


@pytest.mark.parametrize("local", ["memory", "dist"])
async def test_leaves_check_the_first_version_against_the_roots_digest_too(local: str) -> None:
    """The version the relay's sender starts at (version 0 here) reaches its leaves with the
    root's digest, as every later one: the relay damages its copy, and no leaf runs it."""

    def flip(version: int) -> None:
        with torch.no_grad():
            next(t.relay_model.parameters()).view(-1)[3] += 1.0

    t = Tree(before_relay=flip, local=local, integrity=True, apply_mode="copy")
    own = [{k: v.clone() for k, v in m.state_dict().items()} for m in t.leaf_models]
    async with t.stack:
        for scheme in (t.root, t.local, t.upstream):
            await t.stack.enter_async_context(scheme)
        for i in range(len(t.leaves)):
            await t.start_leaf(i)
        try:
            leaves = [leaf.connect(timeout=20) for leaf in t.leaves if leaf is not None]
            outcomes = await asyncio.gather(
                t.root.connect(timeout=20),
                t.upstream.connect(timeout=20),
                t.local.connect(timeout=20),
                *leaves,
                return_exceptions=True,
            )
            for outcome in outcomes[3:]:  # each leaf refused the damaged bytes
                assert isinstance(outcome, aiowsync.ConnectError), outcome
                assert "DigestMismatch" in str(outcome), outcome
            # The relay cannot bring its leaves to version 0: its upstream does not take it.
            assert isinstance(outcomes[1], aiowsync.ConnectError), outcomes[1]
            for m, before in zip(t.leaf_models, own, strict=True):
                assert same(m, before)  # no leaf ran a byte of the damaged copy
        finally:
            for i in reversed(range(len(t.leaves))):
                if t.leaf_stacks[i] is not None:
                    await t.stop_leaf(i)


@pytest.mark.parametrize("local", ["memory", "dist"])
async def test_a_root_digest_of_other_bytes_than_the_leaves_get_is_not_handed_on(
    local: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The root sends bfloat16 (its wire dtype), the relay's sender its float32 copy: the
    root's digests are of other bytes, though of the same bucket count. They are not handed
    on (the leaves check what the relay's own sender digests), and every send goes through."""
    async with tree(local=local, integrity=True, wire_dtype=torch.bfloat16, apply_mode="copy") as t:
        for _ in range(2):
            bump(t.src)
            assert (await t.root.send(timeout=20)).worker_ids == (0,)
            for m in t.leaf_models:
                assert same(m, t.relay_model)  # the relay's float32 copy of the root's bytes
    unfit = [r for r in caplog.records if "do not fit the leaves' layout" in r.getMessage()]
    assert len(unfit) == 1


async def test_a_relay_whose_sender_could_not_start_fails_each_version_it_cannot_pass_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its sender to the leaves fails to start at the first version (say /dev/shm is full):
    that version fails at the relay, and so does the next try, instead of being acknowledged
    for leaves that never get it."""
    from aiowsync._sending.engine import SenderCore

    t = Tree(leaves=1)
    start = SenderCore.start

    async def fail_once(self: SenderCore, *args: Any, **kwargs: Any) -> None:
        monkeypatch.setattr(SenderCore, "start", start)
        raise OSError(28, "No space left on device")

    async with t.stack:
        for scheme in (t.root, t.local, t.upstream):
            await t.stack.enter_async_context(scheme)
        monkeypatch.setattr(SenderCore, "start", fail_once)
        connects = await asyncio.gather(
            t.root.connect(timeout=20), t.upstream.connect(timeout=20), return_exceptions=True
        )
        assert "No space left on device" in str(connects[1]), connects
        with pytest.raises(aiowsync.ConnectError, match=r"could not start \(OSError"):
            await t.upstream.connect(timeout=20)
        with pytest.raises(aiowsync.WeightSyncError, match="could not start"):
            await t.local.connect(timeout=20)


async def test_local_connect_before_the_upstream_is_entered_fails_at_once_with_the_order() -> None:
    t = Tree(leaves=1)
    async with t.root, t.local:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(RuntimeError) as info:
            await t.local.connect(timeout=120)
        assert loop.time() - began < 30  # at once, not at the 120 s deadline
        assert str(info.value) == (
            "the relay's local sender starts once its upstream holds a version, and the "
            "upstream scheme is not entered: enter the upstream (`async with upstream:`) "
            "and connect it first, then wait on `local.connect()` (or await both at once)"
        )
        # Entered afterwards, in the documented order, the same schemes serve.
        async with t.upstream:
            leaf = await t.start_leaf(0)
            await asyncio.gather(
                t.root.connect(timeout=20),
                t.upstream.connect(timeout=20),
                t.local.connect(timeout=20),
                leaf.connect(timeout=20),
            )
            assert t.leaves_hold(0)
            await t.stop_leaf(0)


async def test_an_upstream_that_joins_a_restarted_root_is_refused_until_local_restarts() -> None:
    """A restarted root numbers from 0 again, while the leaves hold the old root's 3: the
    relay must not acknowledge versions its leaves never got (they held "3 or later")."""
    t = Tree(leaves=1)
    async with t.local:
        leaf = await t.start_leaf(0)
        async with t.root, t.upstream:
            await t.connect()
            for _ in range(3):
                bump(t.src)
                await t.root.send(timeout=20)
            assert t.leaves_hold(3)
        bump(t.src, by=100.0)  # the trainer restarts; its new session starts at version 0
        async with t.root, t.upstream:
            joined = await asyncio.gather(
                t.root.connect(timeout=5), t.upstream.connect(timeout=5), return_exceptions=True
            )
            assert isinstance(joined[1], aiowsync.ConnectError)
            assert "its upstream now receives from another sender, at version 0" in str(joined[1])
            assert "below the 3 its leaves run" in str(joined[1])
            assert leaf.version == 3 and not same(t.leaf_models[0], t.src)
        await t.stop_leaf(0)
    # What the error says to do: the relay's local scheme starts again, at the new root's.
    async with t.local:
        leaf = await t.start_leaf(0)
        async with t.root, t.upstream:
            await t.connect()
            bump(t.src)
            assert (await t.root.send(timeout=20)).version == 1
            assert t.leaves_hold(1)
        await t.stop_leaf(0)


async def test_a_leaf_that_left_is_named_in_the_roots_error_and_rejoins_at_the_latest() -> None:
    async with tree() as t:
        bump(t.src)
        await t.root.send(timeout=20)
        await t.stop_leaf(1)
        bump(t.src)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await t.root.send(timeout=20)
        text = info.value.errors[0]
        assert "relay (worker 0): leaves [1] do not hold version 2" in text, text
        assert "leaf 1: gone" in text, text
        # The other leaf runs the version, and so does the relay itself.
        assert t.leaves[0] is not None and t.leaves[0].version == 2
        assert same(t.leaf_models[0], t.src) and t.upstream.version == 2
        # The leaf comes back and is brought to the latest version; sends reach all again.
        leaf = await t.start_leaf(1)
        await leaf.connect(timeout=20)
        assert leaf.version == 2 and same(t.leaf_models[1], t.src)
        bump(t.src)
        result = await t.root.send(timeout=20)
        assert t.leaves_hold(result.version) and result.retries == 0


async def test_a_leaf_still_joining_when_the_root_sends_is_brought_to_that_version() -> None:
    async with tree() as t:
        await t.stop_leaf(1)
        # The leaf's hook holds its welcome's apply, so it is welcomed at version 0 and not yet
        # ready when the root sends version 1 (on a busy host its answer can simply be late).
        joined, release = asyncio.Event(), asyncio.Event()

        async def hold_the_welcome(version: int) -> None:
            if not joined.is_set():
                joined.set()
                await release.wait()

        leaf = pickle.loads(pickle.dumps(t.local))
        leaf.init_on_receiver(model=t.leaf_models[1], worker_idx=1)
        leaf.register_hook(hold_the_welcome)
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(leaf)
        t.leaves[1], t.leaf_stacks[1] = leaf, stack
        connecting = asyncio.create_task(leaf.connect(timeout=20))
        await asyncio.wait_for(joined.wait(), 20)
        bump(t.src)
        sending = asyncio.create_task(t.root.send(timeout=20))
        while t.local.version < 1:  # the relay has staged version 1 for its leaves
            await asyncio.sleep(0.01)
        release.set()
        await connecting
        result = await sending
        assert result.version == 1 and t.leaves_hold(1)


async def test_a_relays_local_scheme_is_not_sent_to_directly_and_takes_one_relay() -> None:
    t = Tree()
    with pytest.raises(RuntimeError, match="each scheme takes part in one relay"):
        t.upstream.relay_to(t.local)
    other = _memory(aiowsync.MemoryChannelFactory())
    other.init_on_sender(model=nn.Linear(2, 2), num_workers=1)
    fresh = pickle.loads(pickle.dumps(t.root))
    fresh.init_on_receiver(model=model(3), worker_idx=0)
    with pytest.raises(ValueError, match="on the very model"):
        fresh.relay_to(other)
    with pytest.raises(RuntimeError, match="is called on the receiver"):
        other.relay_to(t.local)
    async with t.root, t.local:
        with pytest.raises(RuntimeError, match="not for a relay's local scheme"):
            await t.local.send()


class _Reports:
    """The relays' and leaves' reports, from one queue: a wait takes the reports it waits
    for, keeps the others for a later wait, and fails at once if a process it needs ended."""

    def __init__(self, procs: dict[str, Any]) -> None:
        from _workers import SPAWN

        self.queue = SPAWN.Queue()
        self.procs = procs
        """The processes that must stay alive, by name (a test pops those it kills)."""
        self._kept: list[tuple[Any, ...]] = []

    async def take(
        self, kind: str, want: dict[int, Any], *, within: float = 60
    ) -> dict[int, tuple[Any, ...]]:
        """The first report ``(kind, tag, value, ...)`` from each ``tag`` of ``want`` whose
        value is ``want[tag]`` (any value where that is None). A report of ``kind`` that does
        not match is dropped (a leaf's earlier versions); reports of other kinds are kept."""
        import queue
        import time

        got: dict[int, tuple[Any, ...]] = {}

        def sort(event: tuple[Any, ...]) -> None:
            tag = event[1]
            if event[0] != kind:
                self._kept.append(event)
            elif tag in want and tag not in got and want[tag] in (None, event[2]):
                got[tag] = event

        kept, self._kept = self._kept, []
        for event in kept:
            sort(event)
        deadline = time.monotonic() + within
        while set(got) != set(want):
            left = deadline - time.monotonic()
            assert left > 0, f"no {kind} report from {sorted(set(want) - set(got))} ({want})"
            ended = [f"{n} (exit {p.exitcode})" for n, p in self.procs.items() if not p.is_alive()]
            assert not ended, f"waiting for {kind} reports; these processes ended: {ended}"
            try:
                sort(await asyncio.to_thread(self.queue.get, True, min(left, 1.0)))
            except queue.Empty:
                continue
        return got

    async def leaves(self, want: dict[int, int]) -> dict[int, str]:
        """Wait until each leaf ``tag`` of ``want`` reported version ``want[tag]``; the
        digests."""
        return {tag: event[3] for tag, event in (await self.take("leaf", want)).items()}


@pytest.mark.timeout(240)  # three rounds of process start-up, each bounded by LOADED_WITHIN
async def test_a_root_sends_through_two_relays_to_four_shared_memory_leaves() -> None:
    # The root sends over gloo to two relay processes; each relays over shared memory to two
    # leaf processes of its own. Then a leaf, and later a relay, are killed and restarted.
    # A relay's first version waits for its leaves for about the root's ack timeout, so every
    # process loads (spawns, imports torch, builds its model) before any of them connects:
    # no deadline but the loading's own counts the time that takes on a busy host.
    import time

    from _workers import LOADED_WITHIN, SPAWN, digest, leaf_main, make_model, randomize, relay_main

    src = make_model("small")
    root = aiowsync.DistributedWeightSyncScheme(
        backend="gloo", heartbeats=aiowsync.Heartbeats(0.2, 10)
    )
    root.init_on_sender(model=src, num_workers=2)
    procs: dict[str, Any] = {}
    reports = _Reports(procs)
    stop = SPAWN.Event()
    inboxes: dict[int, Any] = {}
    addresses: dict[int, str] = {}

    def start(name: str, target: Any, *args: Any) -> None:
        procs[name] = SPAWN.Process(target=target, args=(*args, reports.queue, stop), daemon=True)
        procs[name].start()

    def start_leaf(tag: int) -> None:
        # Leaf ``tag`` is leaf tag % 2 of relay tag // 2; its relay's address comes on its
        # inbox once it may connect.
        inboxes[tag] = SPAWN.Queue()
        start(f"leaf {tag}", leaf_main, tag, tag % 2, inboxes[tag])

    async def bring_up(relays: list[int]) -> None:
        """Start ``relays`` and their leaves together; once all have loaded, let them
        connect."""
        started = time.monotonic()
        go = SPAWN.Event()
        tags = [tag for r in relays for tag in (2 * r, 2 * r + 1)]
        for r in relays:
            start(f"relay {r}", relay_main, root, r, 2, go)
        for tag in tags:
            start_leaf(tag)
        await reports.take("loaded", dict.fromkeys(tags), within=LOADED_WITHIN)
        got = await reports.take("address", dict.fromkeys(relays), within=LOADED_WITHIN)
        addresses.update({r: event[2] for r, event in got.items()})
        for tag in tags:
            inboxes[tag].put(addresses[tag // 2])
        go.set()
        print(f"relays {relays} and their leaves loaded in {time.monotonic() - started:.1f} s")

    try:
        async with root:
            await bring_up([0, 1])
            await root.connect(timeout=120)
            first = await reports.leaves(dict.fromkeys(range(4), 0))
            assert set(first.values()) == {digest(src)}  # the root's version 0, bytes and number
            for k in range(1, 11):
                randomize(src, k)
                result = await root.send(timeout=60)
                assert result.version == k and result.worker_ids == (0, 1)
                # Each relay took the version at the first attempt, over gloo from the root.
                assert result.retries == 0, result.retried
                got = await reports.leaves(dict.fromkeys(range(4), k))
                assert set(got.values()) == {digest(src)}, k
            # A leaf of relay 1 is killed: the root's next send names it, through its relay.
            procs.pop("leaf 3").kill()
            randomize(src, 11)
            with pytest.raises(aiowsync.RemoteApplyError) as info:
                await root.send(timeout=60)
            assert info.value.version == 11 and info.value.acked == (0,)
            text = info.value.errors[1]
            assert "relay (worker 1): " in text and "leaf 1" in text, text
            print(f"the root's error for worker 1: {text}")
            got = await reports.leaves(dict.fromkeys(range(3), 11))
            assert set(got.values()) == {digest(src)}  # the other leaves hold the version
            # The leaf comes back: it joins at the latest version, and sends reach all again.
            start_leaf(3)
            await reports.take("loaded", {3: None}, within=LOADED_WITHIN)
            inboxes[3].put(addresses[1])
            assert (await reports.leaves({3: 11}))[3] == digest(src)
            randomize(src, 12)
            assert (await root.send(timeout=60)).worker_ids == (0, 1)
            got = await reports.leaves(dict.fromkeys(range(4), 12))
            assert set(got.values()) == {digest(src)}
            # Relay 0 is killed, with its leaves; the root goes on with relay 1 meanwhile.
            for name in ("relay 0", "leaf 0", "leaf 1"):
                procs.pop(name).kill()
            randomize(src, 13)
            await root.send(worker_ids=[1], timeout=60)
            # A new relay 0 joins at the latest version, and new leaves behind it.
            await bring_up([0])
            got = await reports.leaves({0: 13, 1: 13})
            assert set(got.values()) == {digest(src)}
            randomize(src, 14)
            assert (await root.send(timeout=60)).worker_ids == (0, 1)
            got = await reports.leaves(dict.fromkeys(range(4), 14))
            assert set(got.values()) == {digest(src)}
    finally:
        stop.set()
        for proc in procs.values():
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _relay_of(root: aiowsync.WeightSyncScheme, idx: int, leaves: int, seed: int) -> Any:
    """An upstream receiver of ``root`` (worker ``idx``) relaying to a local sender of
    ``leaves``: (upstream, local, their model)."""
    m = model(seed)
    upstream = pickle.loads(pickle.dumps(root))
    upstream.init_on_receiver(model=m, worker_idx=idx)
    local = _memory(aiowsync.MemoryChannelFactory())
    local.init_on_sender(model=m, num_workers=leaves)
    upstream.relay_to(local)
    return upstream, local, m


def _receiver_of(sender: aiowsync.WeightSyncScheme, idx: int, seed: int) -> Any:
    m = model(seed)
    r = pickle.loads(pickle.dumps(sender))
    r.init_on_receiver(model=m, worker_idx=idx)
    return r, m


async def test_relays_of_relays_subset_sends_late_joins_and_shutdown_order() -> None:
    src = model(0)
    root = _memory(aiowsync.MemoryChannelFactory())
    root.init_on_sender(model=src, num_workers=2)  # worker 0: a relay; worker 1: a plain one
    plain, _ = _receiver_of(root, 1, 1)
    async with contextlib.AsyncExitStack() as stack:
        for scheme in (root, plain):
            await stack.enter_async_context(scheme)
        await plain.connect(timeout=20)
        # Sends to the plain worker alone while no relay exists: versions 1 to 3.
        for _ in range(3):
            bump(src)
            await root.send(worker_ids=[1], timeout=20)
        # A relay joins late, and a relay of that relay below it, with one leaf at the bottom.
        up1, local1, _ = _relay_of(root, 0, 1, 2)
        up2, local2, m2 = _relay_of(local1, 0, 1, 3)
        leaf, leaf_model = _receiver_of(local2, 0, 4)
        for scheme in (local1, up1, up2):
            await stack.enter_async_context(scheme)
        async with contextlib.AsyncExitStack() as bottom:
            for scheme in (local2, leaf):
                await bottom.enter_async_context(scheme)
            await asyncio.gather(
                *(s.connect(timeout=20) for s in (root, up1, local1, up2, local2, leaf))
            )
            # Every level starts at the root's latest version, with its bytes.
            assert [s.version for s in (up1, local1, up2, local2, leaf)] == [3] * 5
            assert same(leaf_model, src) and same(m2, src)
            # A subset send leaves the relay out; the next full send skips a number below it.
            bump(src)
            await root.send(worker_ids=[1], timeout=20)
            bump(src)
            result = await root.send(timeout=20)
            assert result.version == 5 and result.worker_ids == (0, 1) and result.retries == 0
            assert leaf.version == local2.version == local1.version == 5
            assert same(leaf_model, src)
        # The bottom relay's local sender (and its leaf) left: the root's sends still go
        # through; that relay applies them and forwards nothing.
        bump(src)
        assert (await root.send(timeout=20)).worker_ids == (0, 1)
        assert up2.version == 6 and same(m2, src) and leaf.version == 5


async def test_a_relay_below_a_restarted_relay_takes_the_root_numbers_that_go_on() -> None:
    """Relay 1 restarts (both its schemes leave and enter again); relay 2 below it joins it
    anew while its own leaf stays up: the numbers are the root's and go on, so relay 2
    takes them, though its upstream's sender session is a new one."""
    src = model(0)
    root = _memory(aiowsync.MemoryChannelFactory())
    root.init_on_sender(model=src, num_workers=1)
    up1, local1, _ = _relay_of(root, 0, 1, 2)
    up2, local2, _ = _relay_of(local1, 0, 1, 3)
    leaf, leaf_model = _receiver_of(local2, 0, 4)
    async with root, local2, leaf:
        for _ in range(2):
            async with local1, up1, up2:
                await asyncio.gather(
                    *(s.connect(timeout=20) for s in (root, up1, local1, up2, local2, leaf))
                    if leaf.version < 0
                    else (s.connect(timeout=20) for s in (up1, local1, up2))
                )
                bump(src)
                result = await root.send(timeout=20)
                assert leaf.version == result.version and same(leaf_model, src)
        assert result.version == 2 and local2.version == 2


async def test_a_leaf_that_never_joins_is_named_before_the_upstreams_hook_limit() -> None:
    # The relay waits for a joining leaf no longer than the upstream allows its hooks (its
    # ack timeout, 3 s here), so the upstream's refusal carries the relay's explanation.
    src = model(0)
    root = _memory(aiowsync.MemoryChannelFactory())
    root.init_on_sender(model=src, num_workers=1)
    m = model(1)
    upstream = pickle.loads(pickle.dumps(root))
    upstream.timeouts = aiowsync.Timeouts(handshake=20, ack=3, transfer=20)
    upstream.init_on_receiver(model=m, worker_idx=0)
    local = _memory(aiowsync.MemoryChannelFactory())
    local.init_on_sender(model=m, num_workers=2)  # leaf 1 never comes
    upstream.relay_to(local)
    leaf, leaf_model = _receiver_of(local, 0, 2)
    async with root, local, leaf, upstream:
        leaf_joined = asyncio.create_task(leaf.connect(timeout=20))
        started = asyncio.get_running_loop().time()
        with pytest.raises(aiowsync.ConnectError) as info:
            await upstream.connect(timeout=20)
        assert asyncio.get_running_loop().time() - started < 10
        text = str(info.value)
        assert "relay (worker 0): leaves [1] do not hold version 0" in text, text
        assert "leaf 1: never connected" in text, text
        await leaf_joined  # the leaf that came holds the root's version 0 all the same
        assert leaf.version == 0 and same(leaf_model, src)
