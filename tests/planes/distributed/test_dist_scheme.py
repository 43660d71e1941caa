"""DistributedWeightSyncScheme with receivers in this process: real ZeroMQ, real gloo groups.

Each receiver's collectives run in its own worker thread, so one process can hold every rank;
process deaths are covered in test_dist_multiprocess.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import os
import pickle
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import aiowsync
import helpers
from aiowsync._planes.base import Source
from aiowsync._planes.dist.buckets import Buckets
from aiowsync._planes.dist.receiver import DistReceiverPlane
from helpers import BEATS, bump, dist_model, dist_system, keys_of, same

pytestmark = pytest.mark.timeout(90)

THREAD_EXIT = 60.0
"""How long a helper thread may take to end: c10d retries a store connection with random
pauses, and gives up well after its own timeout."""


# -- buckets and packing ----------------------------------------------------------------------


def test_bucket_plans_cover_every_byte_once_and_split_straddling_tensors() -> None:
    assert Buckets(total=100, bucket_bytes=33).ranges == [(0, 33), (33, 66), (66, 100)]
    buckets = Buckets(total=100, bucket_bytes=30)
    assert buckets.ranges == [(0, 30), (30, 60), (60, 90), (90, 100)]
    segments = [(0, 10), (16, 50), (70, 30)]  # gaps (alignment) between segments
    plans = buckets.plan(segments)
    assert plans[0] == [(0, 0, 10), (1, 0, 14)]
    assert plans[1] == [(1, 14, 44)]
    assert plans[2] == [(1, 44, 50), (2, 0, 20)]
    assert plans[3] == [(2, 20, 30)]
    covered = sorted((segments[s][0] + a, segments[s][0] + b) for plan in plans for s, a, b in plan)
    assert covered == [(0, 10), (16, 30), (30, 60), (60, 66), (70, 90), (90, 100)]


@contextlib.contextmanager
def _sender_plane(weights: dict[str, torch.Tensor], bucket_bytes: int, **kw: Any) -> Any:
    """A gloo sender plane on the CPU set up for ``weights`` (a state_dict): yields it and
    its layout; the plane is closed after."""
    from aiowsync._planes.dist.plane import DistSenderPlane
    from aiowsync._weights.layout import Layout

    layout = Layout.from_weights(weights)
    plane = DistSenderPlane(
        backend="gloo",
        bucket_bytes=bucket_bytes,
        host="127.0.0.1",
        device=torch.device("cpu"),
        chain_wait=5.0,
        **kw,
    )
    plane.setup(layout)
    try:
        yield plane, layout
    finally:
        plane.close()


@contextlib.contextmanager
def _packing(weights: dict[str, torch.Tensor], bucket_bytes: int) -> Any:
    """A sender plane set up for ``weights``, its packer started on them in a fresh slot:
    yields the plane, its image and the layout."""
    with _sender_plane(weights, bucket_bytes) as (plane, layout):
        image = plane._slots[plane.reserve(set())].value.image
        plane._packer.start(image, Source(tensors=weights))
        yield plane, image, layout


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("bucket_bytes", [1, 64, 1000, 1 << 20])
def test_packing_bucket_by_bucket_gives_the_layouts_image(bucket_bytes: int, plain: bool) -> None:
    m = dist_model(3)
    weights = {k: v.detach() for k, v in m.state_dict().items()}
    if not plain:  # a transposed view: packing goes through tensor views instead of addresses
        weights["2.weight"] = torch.randn(weights["2.weight"].shape[::-1]).t()
        assert not weights["2.weight"].is_contiguous()
    with _packing(weights, bucket_bytes) as (plane, image, layout):
        for index in range(len(plane.buckets.ranges)):
            plane._packer.pack(image, index)
        assert image.complete.is_set()
        views = layout.views(layout.split(image.flat))
        assert all(torch.equal(views[k], weights[k]) for k in weights)


def test_packing_reads_the_memory_it_started_from_though_the_model_gets_other_tensors() -> None:
    m = dist_model(3)
    weights = {k: v.detach().clone() for k, v in m.state_dict().items()}
    expected = {k: v.clone() for k, v in weights.items()}
    with _packing(weights, 64) as (plane, image, layout):
        plane._packer.pack(image, 0)
        # The model's tensors are replaced mid-send and the old ones dropped: their memory
        # must stay ours until the version is packed, not go to the new tensors.
        for k in list(weights):
            weights[k] = None  # type: ignore[assignment]
        gc.collect()
        for k, v in expected.items():
            weights[k] = torch.full_like(v, 7.0)
        plane._packer.seal(image)
        views = layout.views(layout.split(image.flat))
        assert all(torch.equal(views[k], expected[k]) for k in expected)


def test_a_chain_limits_its_links_by_the_models_bucket_not_by_the_bucket_size() -> None:
    # 1 MiB in 32 MiB buckets: before any transfer, a link may stall for four times what
    # 1 MiB takes on a slow link (plus 5 s), not four times 32 MiB's (some 11 s more).
    from aiowsync._planes.dist.chain import ChainLimits
    from aiowsync._planes.dist.links import SLOW_LINK

    one_mib = {"w": torch.zeros(1 << 18)}
    with _sender_plane(one_mib, 32 << 20, topology="chain") as (plane, _):
        limits = plane.chain_limits()
        assert limits is not None
        expected = ChainLimits.for_pace((1 << 20) / SLOW_LINK)
        assert limits.stall == pytest.approx(expected.stall, rel=1e-3)
        assert limits.hop == pytest.approx(expected.hop, rel=1e-3)


MiB = 1 << 20


def test_a_chain_gets_enough_buckets_to_fill_it_and_a_star_keeps_32_mib() -> None:
    from aiowsync._planes.dist.buckets import choose_bucket_bytes

    for total in (16, 64, 256, 1024, 8192):
        assert choose_bucket_bytes(total * MiB, "star", 4) == 32 * MiB
        for members in (2, 3, 4):
            size = choose_bucket_bytes(total * MiB, "chain", members)
            assert size % (MiB // 4) == 0 and MiB <= size <= 32 * MiB
            count = -(-total * MiB // size)
            # The last member gets the last bucket members - 1 bucket times after the first
            # did: with enough buckets, that is a small part of the whole send.
            assert (count + members - 1) / count <= 1.2, (total, members, size)
    assert choose_bucket_bytes(64 * MiB, "chain", 4) == 2 * MiB  # 32 buckets
    assert choose_bucket_bytes(256 * MiB, "chain", 4) == 8 * MiB
    assert choose_bucket_bytes(100, "chain", 4) == MiB


async def test_a_chain_with_its_defaults_sends_in_the_buckets_chosen_for_its_model() -> None:
    def model(seed: int) -> nn.Module:  # 16 MiB
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(1024, 2048, bias=False), nn.Linear(2048, 1024, bias=False))

    async with helpers.system(
        aiowsync.DistributedWeightSyncScheme,
        2,
        make_model=model,
        connect_timeout=30,
        heartbeats=BEATS,
        topology="chain",
    ) as (sender, src, receivers):
        assert sender.bucket_bytes is None  # chosen when the sender started
        plane = sender._sender.plane  # type: ignore[union-attr]
        assert plane.bucket_bytes == MiB and len(plane.buckets.ranges) == 16
        bump(src)
        result = await sender.send(timeout=30)
        assert result.retries == 0
        assert all(r.version == 1 and same(m, src) for r, m in receivers)


# -- the scheme -------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", ["star", "chain"])
async def test_receivers_hold_the_senders_bytes_after_each_send_and_subsets(
    topology: str,
) -> None:
    async with dist_system(3, topology=topology) as (sender, src, receivers):
        for _, m in receivers:
            assert same(m, src)
        for step in range(1, 4):
            bump(src)
            result = await sender.send(timeout=20)
            assert (result.version, result.worker_ids) == (step, (0, 1, 2))
            # Delivered by the first attempt: a retry would hide a chain that stopped
            # forwarding (the stall limit then re-routes, and the bytes still arrive).
            assert (result.retries, result.retried) == (0, ())
            assert all(r.version == step and same(m, src) for r, m in receivers)
        bump(src, 5)
        result = await sender.send(worker_ids=[0, 2], timeout=20)
        assert result.worker_ids == (0, 2) and result.retries == 0
        (r0, m0), (r1, m1), (r2, m2) = receivers
        assert same(m0, src) and same(m2, src) and not same(m1, src)
        assert (r0.version, r1.version, r2.version) == (4, 3, 4)
        result = await sender.send(worker_ids=1, timeout=20)
        assert same(m1, src) and r1.version == 5


async def test_send_of_explicit_weights_and_rehomed_sender() -> None:
    async with dist_system(2, bucket_bytes=1000) as (sender, src, receivers):
        other = {k: v.clone() + 3 for k, v in src.state_dict().items()}
        other["mask"] = ~src.mask  # type: ignore[operator]
        result = await sender.send(other, timeout=20)
        for _, m in receivers:
            state = m.state_dict()
            assert all(torch.equal(state[k], other[k]) for k in other)
        assert result.nbytes >= sum(t.nbytes for t in other.values())

    src = dist_model(1)
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=777, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1, rehome=True)
    async with sender:
        r = aiowsync.DistributedWeightSyncScheme(address=sender.address, channels=keys_of(sender))
        m = dist_model(2)
        r.init_on_receiver(model=m, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            bump(src, 2)
            await sender.send(timeout=20)
            assert same(m, src)


async def test_a_failed_collective_is_retried_on_a_fresh_group() -> None:
    async with dist_system(2) as (sender, src, receivers):
        bump(src)
        await sender.send(timeout=20)
        # Worker 0 drops its group (as its cache would, or as if its connections broke): the
        # next broadcast on it fails, every member fails fast, and both get the version again.
        plane = receivers[0][0]._receiver._plane
        assert isinstance(plane, DistReceiverPlane)
        for name in list(plane._groups._table):
            plane._groups.discard(name)
        gc.collect()
        bump(src)
        result = await sender.send(timeout=20)
        assert result.worker_ids == (0, 1) and result.version == 2
        assert result.retries >= 1 and 0 in result.retried  # the result says how it got there
        assert all(r.version == 2 and same(m, src) for r, m in receivers)
        # And the group formed for the retry serves the next send, at the first attempt.
        bump(src)
        result = await sender.send(timeout=20)
        assert (result.version, result.retries) == (3, 0)
        assert all(same(m, src) for _, m in receivers)


async def test_more_groups_than_the_caches_hold() -> None:
    # Ten joining workers and ten different subsets: more groups than either side caches (8),
    # so groups are evicted on both sides while others are still announced or in use.
    async with dist_system(10, bucket_bytes=8192) as (sender, src, receivers):
        assert all(same(m, src) for _, m in receivers)
        # The first subsets come back after their groups left the receivers' caches.
        for k in [*range(10), 0, 1, 2]:
            subset = sorted({k, (k + 3) % 10, (k + 7) % 10})
            bump(src)
            result = await sender.send(worker_ids=subset, timeout=30)
            assert result.worker_ids == tuple(subset)
            assert all(same(receivers[w][1], src) for w in subset)
        bump(src)
        result = await sender.send(timeout=30)
        assert result.worker_ids == tuple(range(10))
        assert all(r.version == 14 and same(m, src) for r, m in receivers)
        # Only the groups the sender still caches keep rendezvous keys in its store, of the
        # 24 formed (10 joins, 13 subset sends whose 3 repeats were evicted before, 1 full).
        plane = sender._sender.plane  # type: ignore[union-attr]
        named = {key.split("/")[1] for key in plane._groups.store.held_keys()}
        cached = {g.name for g in plane._groups._table.values()}
        assert named and named <= cached


def _uniform(m: nn.Module) -> set[float]:
    return {float(v) for t in m.parameters() for v in t.detach().unique()}


async def test_a_cancelled_send_never_reads_the_model_after_it_returns() -> None:
    # Many small buckets make the transfer long enough to be cancelled half-way; the trainer
    # then changes its model at once. No receiver may ever hold those later values.
    src = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))
    with torch.no_grad():
        for p in src.parameters():
            p.fill_(1.0)
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=4096, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=2)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(sender)
        mirrors = []
        for i in range(2):
            r = aiowsync.DistributedWeightSyncScheme(
                address=sender.address, channels=keys_of(sender)
            )
            m = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))
            r.init_on_receiver(model=m, worker_idx=i)
            await stack.enter_async_context(r)
            mirrors.append((r, m))
        await asyncio.gather(
            sender.connect(timeout=30), *(r.connect(timeout=30) for r, _ in mirrors)
        )
        for value in (2.0, 3.0, 4.0):
            with torch.no_grad():
                for p in src.parameters():
                    p.fill_(value)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sender.send(timeout=20), 0.02)
            with torch.no_grad():
                for p in src.parameters():
                    p.fill_(-1.0)  # what a trainer's next step would do
        await asyncio.sleep(1.0)
        for r, m in mirrors:
            seen = _uniform(m)
            assert len(seen) == 1 and -1.0 not in seen, (r.version, seen)
        # The next send works and brings everyone to the current weights.
        result = await sender.send(timeout=20)
        assert result.worker_ids == (0, 1)
        assert all(_uniform(m) == {-1.0} for _, m in mirrors)


async def test_version_0_is_the_model_at_start_even_for_late_joiners() -> None:
    src = dist_model(0)
    expected = {k: v.clone() for k, v in src.state_dict().items()}
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=2048, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        bump(src, 100)  # after start, before anyone joined: not part of version 0
        r = aiowsync.DistributedWeightSyncScheme(address=sender.address, channels=keys_of(sender))
        m = dist_model(9)
        r.init_on_receiver(model=m, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            state = m.state_dict()
            assert all(torch.equal(state[k], expected[k]) for k in expected)


async def test_hook_failure_is_surfaced_and_the_model_stays_whole() -> None:
    async with dist_system(2) as (sender, src, receivers):

        def broken(version: int) -> None:
            raise RuntimeError(f"cache reset failed at {version}")

        receivers[1][0].register_hook(broken)
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=20)
        assert info.value.acked == (0,)
        assert "cache reset failed at 1" in info.value.errors[1]
        assert same(receivers[0][1], src)


async def test_wrong_model_is_refused_naming_the_difference() -> None:
    async with dist_system(1) as (sender, _, _):
        bad = aiowsync.DistributedWeightSyncScheme(address=sender.address, channels=keys_of(sender))
        bad.init_on_receiver(model=dist_model(0, width=65), worker_idx=0)
        async with bad:
            with pytest.raises(aiowsync.RefusedError, match=r"0\.weight"):
                await bad.connect(timeout=10)


async def test_copy_mode_receiver_keeps_private_tensors() -> None:
    src = dist_model(0)
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=2048, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.DistributedWeightSyncScheme(
            address=sender.address, channels=keys_of(sender), apply_mode="copy"
        )
        m = dist_model(5)
        r.init_on_receiver(model=m, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            plane = r._receiver._plane
            assert isinstance(plane, DistReceiverPlane)
            flats = [f for halves in plane._halves for f in halves.flats]
            slots = [(f.data_ptr(), f.data_ptr() + f.nbytes) for f in flats]
            for _ in range(3):
                bump(src)
                await sender.send(timeout=20)
                assert same(m, src)
                # Copy mode switches between private copies; it never points into a slot.
                for t in m.state_dict().values():
                    assert not any(lo <= t.data_ptr() < hi for lo, hi in slots)


async def test_the_users_default_group_is_never_touched_and_works_beside_ours() -> None:
    assert not dist.is_initialized()
    async with dist_system(1) as (sender, src, receivers):
        bump(src)
        await sender.send(timeout=20)
        assert not dist.is_initialized(), "the scheme must not create the default group"
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=30),
            )
            try:
                t = torch.ones(3)
                dist.all_reduce(t)
                assert torch.equal(t, torch.ones(3))
                bump(src)
                result = await sender.send(timeout=20)
                assert result.version == 2 and same(receivers[0][1], src)
                dist.all_reduce(t)
                assert dist.get_world_size() == 1
            finally:
                dist.destroy_process_group()


def test_configuration_is_checked_and_pickled() -> None:
    with pytest.raises(ValueError, match="backend"):
        aiowsync.DistributedWeightSyncScheme(backend="mpi")  # type: ignore[arg-type]
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="bucket_bytes"):
            aiowsync.DistributedWeightSyncScheme(bucket_bytes=bad)  # type: ignore[arg-type]
    scheme = aiowsync.DistributedWeightSyncScheme(bucket_bytes=1 << 20, data_host="10.0.0.1")
    clone = pickle.loads(pickle.dumps(scheme))
    assert (clone.backend, clone.bucket_bytes, clone.data_host) == ("gloo", 1 << 20, "10.0.0.1")


async def test_a_wildcard_bind_needs_a_data_host() -> None:
    factory = aiowsync.ZmqChannelFactory(allow_insecure_bind=True)
    scheme = aiowsync.DistributedWeightSyncScheme(bind="tcp://0.0.0.0:0", channels=factory)
    scheme.init_on_sender(model=dist_model(), num_workers=1)
    with pytest.raises(ValueError, match="data_host"):
        async with scheme:
            pass


async def test_a_sender_on_every_interface_is_pickled_with_its_data_host() -> None:
    # Before, the copy handed to workers (Ray actors on other nodes) said tcp://0.0.0.0:PORT,
    # which each worker took for its own host: no connect() ever got an answer.
    factory = aiowsync.ZmqChannelFactory(allow_insecure_bind=True)
    src = dist_model(0)
    sender = aiowsync.DistributedWeightSyncScheme(
        bind="tcp://0.0.0.0:0", data_host="127.0.0.1", channels=factory, heartbeats=BEATS
    )
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        port = sender.address.rpartition(":")[2]
        assert sender.address == f"tcp://0.0.0.0:{port}"  # what it listens on
        r = pickle.loads(pickle.dumps(sender))
        assert r.address == f"tcp://127.0.0.1:{port}"  # where a worker reaches it
        mirror = dist_model(1)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            bump(src)
            assert (await sender.send(timeout=20)).worker_ids == (0,)
            assert same(mirror, src)


@pytest.mark.parametrize(
    ("bound", "host", "reached"),
    [
        ("tcp://0.0.0.0:5555", "10.1.2.3", "tcp://10.1.2.3:5555"),
        ("tcp://0.0.0.0:5555", None, "tcp://127.0.0.1:5555"),
        ("tcp://[::]:5555", "fd00::7", "tcp://[fd00::7]:5555"),
        ("tcp://[::]:5555", None, "tcp://[::1]:5555"),
        ("tcp://10.0.0.4:5555", "10.1.2.3", "tcp://10.0.0.4:5555"),
        ("ipc:///tmp/x/control", "10.1.2.3", "ipc:///tmp/x/control"),
    ],
)
def test_the_address_workers_reach_a_sender_on(bound: str, host: str | None, reached: str) -> None:
    from aiowsync._channel import reachable

    assert reachable(bound, host) == reached


async def test_an_ipc_control_socket_needs_a_data_host_and_works_with_one() -> None:
    scheme = aiowsync.DistributedWeightSyncScheme(bind="ipc://@*")
    scheme.init_on_sender(model=dist_model(), num_workers=1)
    with pytest.raises(ValueError, match=r"not a tcp:// address.*data_host"):
        async with scheme:
            pass
    src = dist_model(0)
    sender = aiowsync.DistributedWeightSyncScheme(
        bind="ipc://@*", data_host="127.0.0.1", bucket_bytes=4096, heartbeats=BEATS
    )
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        assert sender.address.startswith("ipc://@aiowsync-")
        r = pickle.loads(pickle.dumps(sender))
        mirror = dist_model(1)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            bump(src)
            assert (await sender.send(timeout=20)).worker_ids == (0,)
            assert same(mirror, src)


async def test_a_send_cancelled_while_announcing_gives_its_group_back() -> None:
    # The update could not be queued at once, and the send was cancelled (asyncio) while it
    # waited: the announcement still goes out, but no transfer will follow. Its group must be
    # dropped: the receivers waiting on it would otherwise take the next version's bytes
    # (same group, same tags) for this version's.
    async with dist_system(2) as (sender, src, receivers):
        core = sender._sender
        assert core is not None and core.channel is not None
        channel = core.channel
        real_send = channel.send

        async def slow_send(peer: Any, message: Any, *, timeout: float | None) -> None:
            await asyncio.sleep(0.3)
            await real_send(peer, message, timeout=timeout)

        channel.send_nowait = lambda peer, message: False  # type: ignore[method-assign]
        channel.send = slow_send  # type: ignore[method-assign]
        bump(src)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sender.send(timeout=20), 0.05)
        del channel.send_nowait, channel.send
        plane = core.plane
        sends = [k for k in plane._groups._table if k[-1] == (-1, "")]  # type: ignore[attr-defined]
        assert sends == []  # (the groups that brought the workers up at connect stay)
        assert all(s.value.readers == 0 for s in plane._slots)  # type: ignore[attr-defined]
        bump(src)
        result = await sender.send(timeout=20)
        assert result.version == 2 and result.worker_ids == (0, 1)
        assert all(r.version == 2 and same(m, src) for r, m in receivers)


async def test_receivers_reach_the_store_on_the_data_host_not_the_control_host() -> None:
    # Control on 127.0.0.1, process groups and store on 127.0.0.2 (another loopback address,
    # as another network card would be).
    src = dist_model(0)
    sender = aiowsync.DistributedWeightSyncScheme(
        bucket_bytes=4096, heartbeats=BEATS, data_host="127.0.0.2"
    )
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = pickle.loads(pickle.dumps(sender))
        mirror = dist_model(1)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            assert same(mirror, src)
            bump(src)
            assert (await sender.send(timeout=20)).worker_ids == (0,)
            assert same(mirror, src)


def test_a_wait_shorter_than_a_millisecond_still_has_a_limit() -> None:
    from aiowsync._planes.dist.collectives import finish

    seen: list[Any] = []

    class Work:
        def wait(self, span: Any) -> None:
            seen.append(span)

    finish(Work(), "gloo", 0.0004, torch.device("cpu"))
    # c10d reads a zero span as "no limit": the smallest it keeps is one millisecond.
    assert seen and seen[0].total_seconds() >= 0.001


async def test_a_worker_slow_to_join_is_still_brought_up_to_date(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker starting beside many others on a busy host may reach its first group late. A
    # send's group gives up forming after a while (its retry needs the time), but the group
    # that brings a joining worker up to date has no retry: it waits out the handshake.
    from aiowsync._planes.dist.groups import ReceiverGroups

    src = dist_model(0)
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=4096, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        core = sender._sender
        assert core is not None
        core.plane._groups.form_timeout = 0.5  # type: ignore[attr-defined]
        join = ReceiverGroups.join

        def late_join(self: ReceiverGroups, *args: Any) -> Any:
            import time

            time.sleep(2.0)  # four times the limit a send's group would allow
            return join(self, *args)

        monkeypatch.setattr(ReceiverGroups, "join", late_join)
        r = pickle.loads(pickle.dumps(sender))
        mirror = dist_model(1)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            assert r.version == 0 and same(mirror, src)
            monkeypatch.undo()
            bump(src)
            assert (await sender.send(timeout=20)).worker_ids == (0,)
            assert same(mirror, src)
