"""Gather copies: many small tensors copied as bytes, their plans, early starts, and the choice a
plane makes between buffers and tensors."""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence

import pytest
import torch

import aiowsync
from aiowsync import Layout
from aiowsync._copy.engine import CopyPolicy
from aiowsync._copy.gather import EarlyCopy, GatherCopy
from aiowsync._copy.job import (
    EARLY_TAILS,
    split_sizes,
)
from aiowsync._copy.recent import Copied, RecentCopies
from aiowsync._planes.base import Source, WeightSource
from aiowsync._planes.shm.sender import SharedMemSenderPlane


def gather_pool_or_skip(policy: CopyPolicy) -> None:
    if policy.gather_pool() is None:
        pytest.skip("torch does not run on OpenMP here")


def mixed_weights(seed: int, count: int = 400) -> dict[str, torch.Tensor]:
    """Tensors of every common dtype, odd byte sizes, scalars and empties: > 4 MiB in all."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.float16, torch.uint8]
    out: dict[str, torch.Tensor] = {}
    for i in range(count):
        dtype = dtypes[i % len(dtypes)]
        n = int(torch.randint(1, 30000, (1,), generator=g))
        shape: tuple[int, ...] = () if i % 37 == 0 else (n,) if i % 3 else (n // 7 + 1, 7)
        if i % 53 == 0:
            shape = (0, 5)
        out[f"t{i:03d}"] = (torch.randn(shape, generator=g) * 100).to(dtype)
    out["big"] = torch.randn(3 * 1024 * 1024, generator=g)  # one tensor larger than a share
    return out


class Guessing:
    """A gather copy and, beside it, what each source (``hint``) copied last, as the
    shared-memory sender keeps them: a call without a hint is a source not seen lately."""

    def __init__(self, gather: GatherCopy) -> None:
        self.gather, self.recent = gather, RecentCopies()

    def start(self, dst: list[torch.Tensor], hint: object = None) -> EarlyCopy | None:
        guess = self.recent.guess(object() if hint is None else hint)
        if guess is None or guess.sources is None:
            return None
        return self.gather.start(dst, guess.sources)

    def copy(
        self,
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        *,
        hint: object = None,
        keep: bool = False,
        early: EarlyCopy | None = None,
    ) -> bool:
        hint = object() if hint is None else hint
        self.recent.forget(hint)
        copied = self.gather.copy(dst, src, keep=keep, early=early)
        if copied is not None:
            self.recent.copied(hint, Copied(sources=copied))
        return copied is not None


@pytest.mark.parametrize("bucket_bytes", [None, 2 * 1024 * 1024])
def test_gather_copy_fills_every_tensor_and_reuses_its_plan(
    bucket_bytes: int | None, policy: CopyPolicy
) -> None:
    gather_pool_or_skip(policy)
    weights = mixed_weights(1)
    layout = Layout.from_weights(weights, bucket_bytes=bucket_bytes)
    assert layout.total_bytes > 4 * 1024 * 1024
    gather = GatherCopy(layout.places, policy)
    dst = [torch.full((n,), 0xAB, dtype=torch.uint8) for n in layout.buffer_sizes]
    src = [weights[k] for k in layout.keys]
    for round_ in range(4):
        for t in src:
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)
        assert gather.copy(dst, src)
        views = layout.views(dst)
        assert all(torch.equal(views[k], weights[k]) for k in layout.keys), round_
        # The plan is kept from the second call with the same sources on.
        assert len(gather._plans) == (1 if round_ >= 1 else 0)
    # A source that moved (new storage, same values) is followed.
    key = layout.keys[5]
    weights[key] = weights[key].clone() + 3
    moved = [weights[k] for k in layout.keys]
    assert gather.copy(dst, moved)
    views = layout.views(dst)
    assert all(torch.equal(views[k], weights[k]) for k in layout.keys)
    # Alternating two source sets keeps a plan for each; a third one is kept in place of
    # the oldest, and a source set passed once is never kept.
    assert gather.copy(dst, src) and gather.copy(dst, moved)
    assert len(gather._plans) == 2
    third = [t.clone() for t in moved]
    for _ in range(3):
        assert gather.copy(dst, third) and gather.copy(dst, moved)
    assert len(gather._plans) == 2 and len(gather._kept) == 2
    once = [t.clone() for t in moved]
    assert gather.copy(dst, once)
    views = layout.views(dst)
    assert all(torch.equal(views[k], t) for k, t in zip(layout.keys, once, strict=True))
    assert tuple(t.data_ptr() for t in once) not in gather._plans
    # Another destination (a sender's next slot) reuses the plan of its sources: only the
    # output ranges are cut for it.
    plan = gather._plans[tuple(t.data_ptr() for t in moved)]
    other = [torch.zeros(n, dtype=torch.uint8) for n in layout.buffer_sizes]
    assert gather.copy(other, moved) and gather.copy(dst, moved)
    assert gather._plans[tuple(t.data_ptr() for t in moved)] is plan
    assert len(plan._destinations) == 2
    for buffers in (other, dst):
        views = layout.views(buffers)
        assert all(torch.equal(views[k], weights[k]) for k in layout.keys)
    with pytest.raises(ValueError, match=r"expected \d+ buffers"):
        gather.copy([*other, other[0]], moved)
    gather.clear()
    assert not gather._plans
    # Sources said to come back (a model's own tensors) are kept from the first call on.
    assert gather.copy(dst, src, keep=True)
    assert len(gather._plans) == 1


def test_gather_copy_declines_what_it_cannot_copy_as_bytes() -> None:
    weights = mixed_weights(2, count=60)
    layout = Layout.from_weights(weights)
    gather = GatherCopy(layout.places)
    dst = layout.allocate()
    src = [weights[k] for k in layout.keys]
    # A strided (non-contiguous) source and a conjugate view are left to fused_copy.
    strided = [*src]
    strided[layout.keys.index("big")] = torch.randn(2 * 3 * 1024 * 1024)[::2]
    assert not gather.copy(dst, strided)
    z = torch.randn(8, dtype=torch.complex64).conj()
    assert z.is_conj()
    lay_c = Layout.from_weights({**weights, "z": z})
    src_c = [{**weights, "z": z}[k] for k in lay_c.keys]
    assert not GatherCopy(lay_c.places).copy(lay_c.allocate(), src_c)
    # Small models are not worth the threads.
    small = {"a": torch.ones(10)}
    lay_s = Layout.from_weights(small)
    assert not GatherCopy(lay_s.places).copy(lay_s.allocate(), [small["a"]])
    assert all(torch.equal(b, torch.zeros_like(b)) for b in dst)


def test_gather_copy_started_early_is_kept_for_the_same_sources_and_redone_otherwise(
    policy: CopyPolicy,
) -> None:
    gather_pool_or_skip(policy)
    weights = mixed_weights(4)
    layout = Layout.from_weights(weights)
    gather = Guessing(GatherCopy(layout.places, policy))
    dst = [torch.zeros(n, dtype=torch.uint8) for n in layout.buffer_sizes]
    src = [weights[k] for k in layout.keys]
    assert gather.start(dst) is None  # nothing copied yet: nothing to start
    assert gather.copy(dst, src, keep=True)
    assert gather.start(dst) is None  # sources seen once: no guess yet
    assert gather.copy(dst, src, keep=True)

    def bump() -> None:
        for t in src:
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)

    # The same tensors, with new values: the early copy is the copy.
    bump()
    early = gather.start(dst)
    assert early is not None
    assert gather.copy(dst, src, keep=True, early=early)
    views = layout.views(dst)
    assert all(torch.equal(views[k], weights[k]) for k in layout.keys)
    # A source that moved: the early copy (of the old tensor) is abandoned and redone.
    key = layout.keys[7]
    old = weights[key]
    weights[key] = old.clone() + 5
    moved = [weights[k] for k in layout.keys]
    early = gather.start(dst)
    assert early is not None
    assert gather.copy(dst, moved, keep=True, early=early)
    views = layout.views(dst)
    assert all(torch.equal(views[k], weights[k]) for k in layout.keys)
    assert not torch.equal(views[key], old)
    # Two source sets in turn: after the first miss, nothing is started for them.
    assert gather.start(dst) is None
    assert gather.copy(dst, src, keep=True) and gather.start(dst) is None
    assert gather.copy(dst, moved, keep=True) and gather.start(dst) is None
    # Sources it cannot copy: declined, and no helper writes into dst afterwards.
    assert gather.copy(dst, moved, keep=True)
    early = gather.start(dst)
    assert early is not None
    strided = [*moved]
    strided[layout.keys.index("big")] = torch.randn(2 * 3 * 1024 * 1024)[::2]
    assert not gather.copy(dst, strided, early=early)
    assert all(f.done() for f in early.job._futures)


def test_gather_copy_guesses_by_hint_for_sources_in_turn(policy: CopyPolicy) -> None:
    gather_pool_or_skip(policy)
    first = mixed_weights(5)
    layout = Layout.from_weights(first)
    second = {k: t.clone() for k, t in first.items()}
    gather = Guessing(GatherCopy(layout.places, policy))
    dst = [torch.zeros(n, dtype=torch.uint8) for n in layout.buffer_sizes]
    sources = {"model": first, "weights": second}
    for turn in range(6):
        hint = "model" if turn % 2 == 0 else "weights"
        weights = sources[hint]
        for t in weights.values():
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)
        early = gather.start(dst, hint)
        # The model's plan is kept from its first turn, the weights' once seen again: each is
        # guessed from the turn after that.
        assert (early is not None) == (turn >= (2 if hint == "model" else 5)), turn
        src = [weights[k] for k in layout.keys]
        assert gather.copy(dst, src, keep=hint == "model", early=early, hint=hint)
        views = layout.views(dst)
        assert all(torch.equal(views[k], weights[k]) for k in layout.keys), turn
    # A hint that now names other tensors: the guess is abandoned and the right ones copied.
    third = {k: ~t if t.dtype == torch.bool else t - 3 for k, t in first.items()}
    early = gather.start(dst, "model")
    assert early is not None
    assert gather.copy(dst, [third[k] for k in layout.keys], early=early, hint="model")
    views = layout.views(dst)
    assert all(torch.equal(views[k], third[k]) for k in layout.keys)
    # An unknown hint falls back to the last call's sources, once they came twice in a row.
    assert gather.start(dst, "other") is None
    assert gather.copy(dst, [first[k] for k in layout.keys], keep=True)
    assert gather.copy(dst, [first[k] for k in layout.keys], keep=True)
    early = gather.start(dst, "other")
    assert early is not None
    early.job.abandon()
    gather.gather.clear()
    assert gather.start(dst, "weights") is None


class _Given(WeightSource):
    """Weights from ``key``, as ``make`` returns them (or the error it raises)."""

    def __init__(self, key: str, make: Callable[[], Source]) -> None:
        self._key, self._make = key, make

    @property
    def key(self) -> object:
        return self._key

    def snapshot(self) -> Source:
        return self._make()


def stage(plane: SharedMemSenderPlane, slot: int, key: str, make: Callable[[], Source]) -> None:
    """Stage into ``slot`` as the plane's staging thread does (checked by ``make``)."""
    plane._stage([plane._tables[""][slot].value], _Given(key, make))


def slot_parts(plane: SharedMemSenderPlane, slot: int) -> list[torch.Tensor]:
    return plane._tables[""][slot].value.parts


def test_a_plane_guesses_by_hint_between_buffers_and_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    weights = mixed_weights(6, count=40)
    layout = Layout.from_weights(weights)
    homed = layout.allocate()
    views = layout.views(homed)
    started: list[str] = []
    home = sys.modules[SharedMemSenderPlane.__module__]  # where the plane finds start_copy
    real_start_copy = home.start_copy

    def spy_flat(
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        early: float = 0.0,
        policy: CopyPolicy | None = None,
    ) -> object:
        job = real_start_copy(dst, src, early, policy)
        if job is not None:
            started.append("homed")
        return job

    monkeypatch.setattr(home, "start_copy", spy_flat)
    plane = SharedMemSenderPlane()
    plane.setup(layout)
    real_start = plane._gather.start

    def spy(dst: Sequence[torch.Tensor], key: tuple[int, ...]) -> EarlyCopy | None:
        early = real_start(dst, key)
        if early is not None:
            started.append("weights")  # only the weights go through the gather copy
        return early

    plane._gather.start = spy  # type: ignore[method-assign]
    try:
        for turn in range(6):
            hint = "homed" if turn % 2 == 0 else "weights"
            for t in [*homed, *weights.values()]:
                t.bitwise_not_() if t.dtype in (torch.bool, torch.uint8) else t.add_(1)
            if hint == "homed":
                source = Source(buffers=tuple(homed))
                expected = homed
            else:
                source = Source(tensors=weights)
                expected = [torch.zeros_like(b) for b in homed]
                layout.pack(weights, layout.views(expected))
            slot = turn % 2
            stage(plane, slot, hint, lambda source=source: source)
            got = slot_parts(plane, slot)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), turn
        # Each kind was copied early once seen (the tensors once their plan was kept), though
        # every staging before it had copied the other kind.
        assert started == ["homed", "homed", "weights"]
        homed_copy, weights_copy = plane._recent.last("homed"), plane._recent.last("weights")
        assert homed_copy is not None and homed_copy.buffers is not None
        assert weights_copy is not None and weights_copy.sources is not None
        assert views  # the homed views stay valid
    finally:
        plane.close()


def test_a_plane_keeps_an_early_copy_only_of_the_same_buffers(policy: CopyPolicy) -> None:
    layout = Layout.from_weights({"w": torch.zeros(2 << 20), "b": torch.zeros(3)})
    plane = SharedMemSenderPlane(policy=policy)
    plane.setup(layout)
    try:
        first = layout.allocate()
        for b in first:
            b.fill_(1)
        stage(plane, 0, "model", lambda: Source(buffers=tuple(first)))
        assert all(torch.equal(a, b) for a, b in zip(slot_parts(plane, 0), first, strict=True))
        # The same buffers with new values: copied (early) into the other slot.
        for b in first:
            b.fill_(2)
        stage(plane, 1, "model", lambda: Source(buffers=tuple(first)))
        assert all(torch.equal(a, b) for a, b in zip(slot_parts(plane, 1), first, strict=True))
        # Other buffers: the early copy of the old ones is abandoned, the new ones copied.
        other = [torch.full_like(b, 7) for b in first]
        stage(plane, 1, "model", lambda: Source(buffers=tuple(other)))
        assert all(torch.equal(a, b) for a, b in zip(slot_parts(plane, 1), other, strict=True))

        # A check that fails stops the early copy before the error comes out.
        def refuse() -> Source:
            raise aiowsync.LayoutMismatchError("no")

        with pytest.raises(aiowsync.LayoutMismatchError):
            stage(plane, 0, "model", refuse)
        for b in other:
            b.fill_(9)
        stage(plane, 0, "model", lambda: Source(buffers=tuple(other)))
        assert all(torch.equal(a, b) for a, b in zip(slot_parts(plane, 0), other, strict=True))
    finally:
        plane.close()


def _share_bytes(share: object) -> int:
    """Bytes one thread's share of a gather copy fills, plain or packed."""
    if isinstance(share, array.array):
        return sum(share[2::3])  # packed (dst, src, nbytes) moves
    assert isinstance(share, list)
    return sum(out.numel() for _, out in share)


def test_a_gather_copy_started_early_cuts_by_its_layout(policy: CopyPolicy) -> None:
    few = {f"w{i}": torch.randn(1 << 20) for i in range(4)}  # 16 MiB in 4 tensors
    lay = Layout.from_weights(few)
    gather = GatherCopy(lay.places, policy)
    dst = lay.allocate()
    src = [few[k] for k in lay.keys]
    copied = gather.copy(dst, src, keep=True)
    assert copied is not None
    early = gather.start(dst, copied)
    assert early is not None
    try:
        # the helper's tail is the usual one: the check of four tensors takes no time
        usual_tails = split_sizes(lay.total_bytes, gather._plans[early.key]._threads)[1]
        tail_bytes = sum(map(_share_bytes, early.job._tails))
        assert tail_bytes == sum(usual_tails)
        assert tail_bytes < EARLY_TAILS * lay.total_bytes
    finally:
        assert gather.copy(dst, src, early=early)
    for spec in lay.specs:
        got = dst[spec.buffer][spec.offset : spec.offset + spec.nbytes].view(torch.float32)
        assert torch.equal(got, few[spec.key])


def test_a_plan_whose_sources_moved_in_place_is_not_used_again(policy: CopyPolicy) -> None:
    """``share_memory_()`` moves a storage under its tensors and frees the old memory, where
    other tensors may come to lie: a plan kept under the old pointers would copy the moved
    model for them. The plan must be found stale, by its early start and by its copy."""
    gather_pool_or_skip(policy)
    model = torch.full((2_000_000,), 1.0)
    params = list(model.chunk(4))
    layout = Layout.from_weights({f"p{i}": p for i, p in enumerate(params)})
    gather = GatherCopy(layout.places, policy)
    dst = layout.allocate()
    key = gather.copy(dst, params, keep=True)
    assert key is not None and key in gather._plans
    early = gather.start(layout.allocate(), key)
    assert early is not None
    early.job.abandon()
    model.share_memory_()  # same tensors, memory elsewhere
    assert tuple(p.data_ptr() for p in params) != key
    assert gather.start(layout.allocate(), key) is None
    assert key not in gather._plans and key not in gather._kept
    model.fill_(3.0)
    assert gather.copy(dst, params, keep=True)
    assert all(bool((v == 3.0).all()) for v in layout.views(dst).values())
