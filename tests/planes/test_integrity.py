"""Digests of each version's bytes (issue 25, deliver 6): carried in the update, checked by
every receiver before it switches; bytes that differ are never applied."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

import aiowsync
import helpers
from _workers import damage_forwards
from aiowsync._planes.digest import DigestMismatch, bucket_bytes, check_digest, digest
from aiowsync._planes.shm.sender import SharedMemSenderPlane
from aiowsync._weights.layout import Layout
from helpers import bump, same

pytestmark = pytest.mark.timeout(120)

BEATS = aiowsync.Heartbeats(interval=0.1, missed=50)


def test_a_flipped_byte_is_named_by_its_bucket_and_keys() -> None:
    layout = Layout.from_weights(
        {"a": torch.zeros(3 << 20), "b": torch.zeros(5 << 20), "c": torch.zeros(16)}
    )
    buffers = layout.allocate()
    for buf in buffers:
        buf.random_(0, 255)
    expected = digest(layout, buffers)
    size = bucket_bytes(layout)
    assert size == 8 << 20 and expected.startswith(f"xxh3:{size}:")
    check_digest(layout, buffers, expected)  # the same bytes pass
    views = layout.views(buffers)
    views["b"].view(torch.uint8)[-1] ^= 1  # the last byte of b: the fourth 8 MiB bucket
    with pytest.raises(DigestMismatch) as info:
        check_digest(layout, buffers, expected)
    text = str(info.value)
    assert text.startswith("bucket 3 of 5 (bytes 25165824-33554432 of buffer 0: b)")
    assert "the version was not applied" in text
    for wrong in ("", "crc32:1:00", expected[:-16], expected.replace(f":{size}:", ":4096:")):
        with pytest.raises(DigestMismatch, match="does not fit this model"):
            check_digest(layout, buffers, wrong)


def test_the_digest_does_not_depend_on_where_the_buffers_live() -> None:
    # The sender digests its slot, a receiver what it fetched: the same bytes, other memory.
    layout = Layout.from_weights({f"k{i}": torch.randn(i + 1) for i in range(1000)})
    a = layout.allocate()
    layout.pack({f"k{i}": torch.full((i + 1,), float(i)) for i in range(1000)}, layout.views(a))
    b = [buf.clone() for buf in a]
    assert digest(layout, a) == digest(layout, b)


@pytest.mark.parametrize("bucket_mib", [1, 3, 32])
def test_a_digest_made_bucket_by_bucket_is_the_staged_one(bucket_mib: int) -> None:
    # A plane that hashes each transfer bucket as it is packed or arrives (whatever its size,
    # and across the models of a layout of several) makes the digest of the whole version.
    from aiowsync._planes.digest import Chunks, seal, unseal
    from aiowsync._planes.dist.buckets import Buckets, section_spans

    weights = {"pi.a": torch.zeros(3 << 20), "pi.b": torch.zeros(1000), "v.c": torch.zeros(5 << 20)}
    layout = Layout.from_weights(weights, sectioned=True)  # two models: pi and v
    assert list(layout.sections) == ["pi", "v"]
    buffers = layout.allocate()
    for buf in buffers:
        buf.random_(0, 255)
    image = torch.cat(buffers)
    buckets = Buckets(layout.total_bytes, bucket_mib << 20, section_spans(layout))
    chunks = Chunks(layout, buckets.ranges)
    hashes: dict[int, int] = {}
    for index in range(len(buckets.ranges)):
        for chunk in chunks.completed_by[index]:
            assert chunk not in hashes  # each digest bucket is completed by one bucket alone
            hashes[chunk] = chunks.hash(image, chunk)
    expected = digest(layout, buffers)
    assert chunks.text([hashes[c] for c in range(len(hashes))]) == expected
    chunks.check(list(hashes.values()), expected)
    image[-1] ^= 1  # the last byte: the last digest bucket
    last = len(chunks.spans) - 1
    hashes[last] = chunks.hash(image, last)
    with pytest.raises(DigestMismatch, match=f"^bucket {last} of {last + 1} "):
        chunks.check([hashes[c] for c in range(len(hashes))], expected)
    key = bytes(range(16))
    assert unseal(seal(expected, key), key) == expected
    with pytest.raises(DigestMismatch, match="is not the sender's"):
        unseal(seal(expected, key), bytes(16))


def _flip(buffers: list[torch.Tensor], where: int = 1000) -> None:
    flat = buffers[0]
    flat[where] = flat[where] ^ 0x5A


async def test_a_memory_plane_update_with_a_bad_bucket_is_refused_and_the_model_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheme = functools.partial(
        aiowsync.WeightSyncScheme,
        plane=aiowsync.MemoryPlane(),
        channels=aiowsync.MemoryChannelFactory(),
        heartbeats=BEATS,
        integrity=True,
    )
    async with helpers.system(scheme, 2) as (sender, src, receivers):
        for _ in range(3):
            bump(src)
            assert (await sender.send(timeout=20)).retries == 0
            assert all(same(m, src) for _, m in receivers)
        kept = [copy.deepcopy(m.state_dict()) for _, m in receivers]
        # The slot changes after the sender digested it, before any receiver reads it.
        plane = sender._sender.plane  # type: ignore[union-attr]
        deliver = plane.deliver

        def corrupt(version: int, *args: Any, **kwargs: Any) -> Any:
            _flip(plane.buffers_of(plane._slots.index_of(version)))
            return deliver(version, *args, **kwargs)

        monkeypatch.setattr(plane, "deliver", corrupt)
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=20)
        assert info.value.version == 4 and info.value.acked == ()
        for worker in (0, 1):
            assert info.value.errors[worker].startswith("DigestMismatch: bucket 0 of 1 (bytes 0-")
        for (r, m), before in zip(receivers, kept, strict=True):
            assert r.version == 3
            assert same(m, before)
        monkeypatch.undo()
        bump(src)
        result = await sender.send(timeout=20)
        assert result.worker_ids == (0, 1) and result.retries == 0
        assert all(r.version == 5 and same(m, src) for r, m in receivers)


@pytest.mark.parametrize("switch", ["rebind", "remap"])
async def test_a_shared_memory_slot_changed_after_its_digest_is_refused(
    monkeypatch: pytest.MonkeyPatch, switch: str
) -> None:
    scheme = functools.partial(
        aiowsync.SharedMemWeightSyncScheme, heartbeats=BEATS, integrity=True, switch=switch
    )
    async with helpers.system(scheme, 2) as (sender, src, receivers):
        bump(src)
        await sender.send(timeout=20)
        assert all(r.version == 1 and same(m, src) for r, m in receivers)
        kept = [copy.deepcopy(m.state_dict()) for _, m in receivers]
        plane = sender._sender.plane  # type: ignore[union-attr]
        assert isinstance(plane, SharedMemSenderPlane)
        deliver = plane.deliver

        def corrupt(version: int, *args: Any, **kwargs: Any) -> Any:
            table = plane._tables[""]
            _flip(table[table.index_of(version)].value.parts, where=7)
            return deliver(version, *args, **kwargs)

        monkeypatch.setattr(plane, "deliver", corrupt)
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=20)
        assert sorted(info.value.errors) == [0, 1] and "bucket 0 of 1" in info.value.errors[0]
        for (r, m), before in zip(receivers, kept, strict=True):
            assert r.version == 1
            assert same(m, before)
        monkeypatch.undo()
        bump(src)
        await sender.send(timeout=20)
        assert all(r.version == 3 and same(m, src) for r, m in receivers)


def _wide(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 2048), nn.Linear(2048, 1024))  # 12 MiB: 2 buckets


class _DamagesOnTheWay:
    """The sender's process group, whose send of bucket ``tag`` to rank ``rank`` carries a
    flipped byte (a link that damages what it carries)."""

    def __init__(self, pg: Any, rank: int, tag: int, where: int) -> None:
        self._pg, self._rank, self._tag, self._where = pg, rank, tag, where
        self._kept: list[torch.Tensor] = []  # alive until the group goes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        if dst != self._rank or tag != self._tag:
            return self._pg.send(tensors, dst, tag)
        bad = [t.clone() for t in tensors]
        _flip(bad, where=self._where)
        self._kept += bad
        return self._pg.send(bad, dst, tag)


def _damage_on_the_way(
    monkeypatch: pytest.MonkeyPatch, rank: int, tag: int, where: int = 5
) -> None:
    """The sender's sends of bucket ``tag`` (the bucket count: the digest that follows the
    bytes) to rank ``rank`` are damaged from now on, at byte ``where`` of the bucket."""
    from aiowsync._planes.dist import plane as dist_plane

    real = dist_plane.send_buckets

    def damaging(pg: Any, *args: Any, **kwargs: Any) -> None:
        real(_DamagesOnTheWay(pg, rank, tag, where), *args, **kwargs)

    monkeypatch.setattr(dist_plane, "send_buckets", damaging)


def _wide_system(workers: int, bucket_bytes: int, connect_timeout: float = 30, **kw: Any) -> Any:
    """A gloo sender of the wide model and ``workers`` receivers (see ``helpers.system``)."""
    return helpers.system(
        aiowsync.DistributedWeightSyncScheme,
        workers,
        make_model=_wide,
        connect_timeout=connect_timeout,
        heartbeats=BEATS,
        bucket_bytes=bucket_bytes,
        **kw,
    )


async def _undamaged_send_reaches_all(
    monkeypatch: pytest.MonkeyPatch, sender: Any, src: nn.Module, receivers: Any
) -> None:
    """With the damage undone, the next version goes to every worker at the first attempt."""
    monkeypatch.undo()
    bump(src)
    assert (await sender.send(timeout=30)).retries == 0
    assert all(r.version == 3 and same(m, src) for r, m in receivers)


@pytest.mark.parametrize("what", ["bucket", "digest"])
async def test_bytes_damaged_on_their_way_over_gloo_are_refused_by_that_worker_alone(
    monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    # The digest follows the bytes on the data plane, sealed with a key that only the update
    # carries: damage to a bucket fails the bucket's hash, damage to the digest its seal.
    async with _wide_system(2, 1 << 20) as (sender, src, receivers):
        assert sender._sender.digests.enabled  # type: ignore[union-attr]  # on by default here
        bump(src)
        # Checked and switched at the first attempt: a check that refused good bytes must
        # show, not pass unseen on a retry.
        assert (await sender.send(timeout=30)).retries == 0
        kept = copy.deepcopy(receivers[1][1].state_dict())
        buckets = sender._sender.plane.buckets.ranges  # type: ignore[union-attr]
        # Worker 1 is rank 2; 1 MiB buckets: bucket 9 lies in the second 8 MiB digest bucket.
        _damage_on_the_way(monkeypatch, rank=2, tag=9 if what == "bucket" else len(buckets))
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=30)
        assert info.value.acked == (0,) and list(info.value.errors) == [1]
        if what == "bucket":
            assert info.value.errors[1].startswith("DigestMismatch: bucket 1 of 2 (bytes 8388608-")
        else:
            assert info.value.errors[1].startswith(
                "DigestMismatch: the digest that came with the bytes is not the sender's"
            )
        assert receivers[0][0].version == 2 and same(receivers[0][1], src)
        r1, m1 = receivers[1]
        assert r1.version == 1
        assert same(m1, kept)
        await _undamaged_send_reaches_all(monkeypatch, sender, src, receivers)


@pytest.mark.parametrize("chunk", [0, 1])
async def test_damage_in_either_digest_bucket_of_one_transfer_bucket_is_named(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    # One 32 MiB transfer bucket holds the model's two digest buckets: the receiver hashes
    # both once it arrived, and names the one that differs.
    async with _wide_system(2, 32 << 20) as (sender, src, receivers):
        assert len(sender._sender.plane.buckets.ranges) == 1  # type: ignore[union-attr]
        bump(src)
        assert (await sender.send(timeout=30)).retries == 0
        kept = copy.deepcopy(receivers[0][1].state_dict())
        _damage_on_the_way(monkeypatch, rank=1, tag=0, where=5 + chunk * (9 << 20))
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=30)
        assert list(info.value.errors) == [0]
        assert info.value.errors[0].startswith(f"DigestMismatch: bucket {chunk} of 2 (bytes ")
        assert receivers[0][0].version == 1 and same(receivers[0][1], kept)
        assert receivers[1][0].version == 2 and same(receivers[1][1], src)
        await _undamaged_send_reaches_all(monkeypatch, sender, src, receivers)


async def test_a_chain_member_that_damages_what_it_forwards_is_named_and_routed_around(
    request: pytest.FixtureRequest,
) -> None:
    # N2. Before: worker 1 acked (its own bytes were right), workers 2 and 3 after it nacked
    # DigestMismatch and the send failed naming only them; the next send failed the same way,
    # since the chain was built in the same order. Now those after it are sent the version
    # again, within the same send, on a chain without it; it is named; and later chains put it
    # last, where it forwards to nobody.
    chain = _wide_system(4, 1 << 20, connect_timeout=60, topology="chain")
    async with chain as (sender, src, receivers):
        bump(src)
        first = await sender.send(timeout=60)
        assert first.retries == 0 and first.suspects == ()
        undo = damage_forwards(only=lambda worker: worker == 1)
        request.addfinalizer(undo)
        bump(src)
        result = await sender.send(timeout=60)
        assert result.worker_ids == (0, 1, 2, 3)
        assert result.suspects == (1,) and result.retried == (2, 3)
        assert result.retries in (1, 2)  # one attempt for both, or one each as their nacks came
        assert all(r.version == 2 and same(m, src) for r, m in receivers)  # exact bytes
        bump(src)  # worker 1 still damages what it forwards, last in the chain now
        later = await sender.send(timeout=60)
        assert later.retries == 0 and later.suspects == ()
        assert all(r.version == 3 and same(m, src) for r, m in receivers)
        print(
            f"damaging member: send with one retry took {result.seconds:.2f} s "
            f"(clean {first.seconds:.2f} s), the next {later.seconds:.2f} s"
        )


async def test_digests_are_off_on_one_host_unless_asked_for() -> None:
    async with helpers.system(aiowsync.SharedMemWeightSyncScheme, 1, heartbeats=BEATS) as (
        sender,
        src,
        receivers,
    ):
        assert not sender._sender.digests.enabled  # type: ignore[union-attr]
        bump(src)
        await sender.send(timeout=20)
        assert same(receivers[0][1], src)
    with pytest.raises(TypeError, match="integrity must be True, False or None"):
        aiowsync.SharedMemWeightSyncScheme(integrity="yes")  # type: ignore[arg-type]
