"""Models and weight containers of unusual shapes: every byte must still arrive, or the
error must be clear. Real ZeroMQ and real /dev/shm slots, receivers in this process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import aiowsync
from helpers import pair, same

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("apply_mode", ["swap", "copy"])
async def test_a_receiver_given_a_tensordict_of_parameters_receives_every_version(
    apply_mode: str,
) -> None:
    torch.manual_seed(0)
    src, mirror = nn.Linear(8, 4), nn.Linear(8, 4)
    td = TensorDict.from_module(mirror)  # its leaves are mirror's Parameters (requires_grad)
    async with pair(src, td, apply_mode=apply_mode) as (sender, r):
        for step in range(1, 4):
            with torch.no_grad():
                src.weight.add_(1.0)
            result = await sender.send(timeout=10)
            assert r.version == result.version == step
            # Before: the receiver re-pointed detached copies, and these stayed at version 0.
            assert torch.equal(td["weight"], src.weight) and torch.equal(mirror.weight, src.weight)


class OddStride(nn.Module):
    """4 MiB and more (so the copy is gathered in threads), plus a one-element parameter whose
    stride is not 1: torch calls it contiguous, ``reshape(-1).view(uint8)`` refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(1024, 1024))
        self.scale = nn.Parameter(torch.randn(3, 3).t()[0, :1])


async def test_a_one_element_parameter_with_an_odd_stride_is_copied() -> None:
    torch.manual_seed(0)
    src, mirror = OddStride(), OddStride()
    assert src.scale.stride() != (1,) and src.scale.is_contiguous()
    async with pair(src, mirror) as (sender, r):
        assert same(mirror, src)
        with torch.no_grad():
            src.scale.fill_(7.0)
            src.big.add_(1.0)
        await sender.send(timeout=10)
        assert same(mirror, src) and float(mirror.scale.detach()) == 7.0


async def test_a_lazily_negated_real_tensor_is_copied() -> None:
    class Negated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Parameter(torch.randn(1024, 1024))
            z = torch.randn(16, dtype=torch.complex64)
            self.register_buffer("imag", z.conj().imag)  # float32, negation bit set

    torch.manual_seed(0)
    src, mirror = Negated(), Negated()
    assert src.imag.is_neg()
    async with pair(src, mirror) as (sender, r):
        assert torch.equal(mirror.imag, src.imag.resolve_neg())
        await sender.send(timeout=10)
        assert same(mirror, src)


async def test_a_rehomed_parameter_transposed_in_place_arrives_transposed() -> None:
    torch.manual_seed(0)
    src, mirror = nn.Linear(6, 6), nn.Linear(6, 6)
    async with pair(src, mirror, rehome=True) as (sender, r):
        assert sender._sending.source._flat is not None  # re-homed
        with torch.no_grad():
            src.weight.t_()  # same data pointer, other strides
        await sender.send(timeout=10)
        # Before: the flat buffer was sent as it was, untransposed.
        assert torch.equal(mirror.weight, src.weight)
        assert sender._sending.source._flat is None  # fell back to per-tensor copies


async def test_a_module_whose_tensors_share_memory_is_not_rehomed() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))
            self.register_buffer("head", self.w.data[:2])  # a view of w

    src, mirror = Shared(), Shared()
    async with pair(src, mirror, rehome=True) as (sender, r):
        assert sender._sending.source._flat is None  # refused: it would have split w and head apart
        with torch.no_grad():
            src.w.add_(1.0)
        assert torch.equal(src.head, torch.ones(2))  # still a view of w
        await sender.send(timeout=10)
        assert same(mirror, src)


def test_a_receiver_on_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    r = aiowsync.SharedMemWeightSyncScheme(address="ipc://@x")
    with pytest.raises(ValueError, match="meta device"):
        r.init_on_receiver(model=model, worker_idx=0)


def test_distributed_packing_reads_odd_strides_and_lazy_views() -> None:
    from aiowsync._planes.dist.buckets import as_bytes as _as_bytes

    odd = torch.randn(3, 3).t()[0, :1]
    z = torch.randn(4, dtype=torch.complex64)
    for t, expected in ((odd, torch.tensor([float(odd)])), (z.conj(), z.conj().resolve_conj())):
        got = _as_bytes(t)
        assert torch.equal(got, expected.contiguous().view(-1).view(torch.uint8))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)


async def test_a_model_with_tied_weights_and_a_non_persistent_buffer_sends() -> None:
    torch.manual_seed(0)
    src, mirror = Tied(), Tied()
    async with pair(src, mirror) as (sender, r):
        with torch.no_grad():
            src.emb.weight.add_(1.0)
            src.inv_freq.add_(1.0)
        await sender.send(src, timeout=10)  # the module itself: its own listing
        assert r.version == 1 and same(mirror, src)
        assert torch.equal(mirror.inv_freq, src.inv_freq)
        assert mirror.head.weight is mirror.emb.weight  # still tied on the worker
        # The state_dict lists the tied weight twice and leaves the buffer out: refused,
        # with both named.
        with pytest.raises(aiowsync.LayoutMismatchError) as info:
            await sender.send(src.state_dict(), timeout=10)
        text = "\n".join(info.value.differences)
        assert "head.weight" in text and "inv_freq" in text


async def test_a_rehomed_model_is_rehomed_again_in_a_later_session() -> None:
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    for _session in range(2):
        mirror = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        async with pair(src, mirror, rehome=True) as (sender, r):
            # Its tensors are views of one buffer now, side by side: not "sharing memory".
            assert sender._sending.source._flat is not None
            with torch.no_grad():
                src[0].weight.add_(1.0)
            await sender.send(timeout=10)
            assert same(mirror, src)


def test_rehoming_refuses_overlapping_memory_only() -> None:
    from aiowsync._weights.binding import rehome
    from aiowsync._weights.layout import Layout

    class SideBySide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.zeros(10)
            self.a = nn.Parameter(flat[:4])
            self.b = nn.Parameter(flat[4:])

    m = SideBySide()
    rehome(m, Layout.from_weights(m))  # views of one buffer, not overlapping: fine

    class Overlap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))
            self.register_buffer("head", self.w.data[1:3])

    o = Overlap()
    with pytest.raises(ValueError, match="share memory"):
        rehome(o, Layout.from_weights(o))


@pytest.mark.parametrize("rehome", [False, True])
async def test_sending_the_bound_model_by_name_is_the_same_as_send(
    rehome: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``send(model)`` with the model given at init goes the way of ``send()``: it does not walk
    and detach every parameter again (about a millisecond for 1000 of them), and what the
    model holds, even a replaced parameter, still arrives. Another module of the same layout
    is still walked, and sent."""
    from aiowsync._sending import source as _scheme

    torch.manual_seed(0)
    src, mirror, other = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)
    walked: list[object] = []
    real = _scheme.flatten_weights

    def counting(weights: Any, **kw: Any) -> Any:
        walked.append(weights)
        return real(weights, **kw)

    async with pair(src, mirror, rehome=rehome) as (sender, r):
        monkeypatch.setattr(_scheme, "flatten_weights", counting)
        with torch.no_grad():
            src.weight.add_(1.0)
        await sender.send(src, timeout=10)
        assert same(mirror, src) and r.version == 1
        src.bias = nn.Parameter(torch.full((4,), 5.0))  # a new tensor object
        await sender.send(src, timeout=10)
        assert same(mirror, src) and float(mirror.bias.detach()[0]) == 5.0
        assert walked == []
        await sender.send(other, timeout=10)
        assert same(mirror, other) and walked == [other]


@pytest.mark.parametrize("kind", ["tensordict", "named_parameters"])
async def test_weights_that_require_grad_are_sent_as_they_are(kind: str) -> None:
    """Leaves that require grad (``TensorDict.from_module`` of a live model) are read as they
    are, big enough for the threaded copy: every byte arrives, and the sender's tensors keep
    their grad state and gain no graph."""
    torch.manual_seed(0)
    src, mirror, other = OddStride(), OddStride(), OddStride()
    async with pair(src, mirror) as (sender, r):
        for step in range(1, 3):
            with torch.no_grad():
                other.big.add_(1.0)
            weights: Any = dict(other.named_parameters())
            if kind == "tensordict":
                weights = TensorDict.from_module(other)
            leaves = list(weights.values())
            assert all(t.requires_grad for t in leaves)
            result = await sender.send(weights, timeout=10)
            assert result.version == r.version == step
            assert same(mirror, other)
            assert all(t.requires_grad and t.grad_fn is None and t.grad is None for t in leaves)


async def test_apply_weights_writes_only_into_a_receiver_that_is_not_switching() -> None:
    """Before connect() and after the session it writes in place; while connected it is
    refused (in swap mode the model reads memory mapped read only, and a write would be a
    version nobody sent), as is ``inplace=False`` (tensors the receiver never updates)."""
    torch.manual_seed(0)
    src, mirror, other = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)
    r = aiowsync.SharedMemWeightSyncScheme(address="ipc://@unused")
    r.init_on_receiver(model=mirror, worker_idx=0)
    r.apply_weights(other.state_dict())
    assert same(mirror, other)
    with pytest.raises(ValueError, match="inplace=False"):
        r.apply_weights(other.state_dict(), inplace=False)
    async with pair(src, mirror) as (sender, r):
        assert same(mirror, src)
        with pytest.raises(RuntimeError, match="on a connected receiver"):
            r.apply_weights(other.state_dict())
        assert same(mirror, src) and r.version == 0
    r.apply_weights(other.state_dict())  # the session ended: the model is the user's again
    assert same(mirror, other)


def test_a_model_too_large_to_describe_in_a_hello_is_refused_at_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's hello lists every tensor; one larger than a control message may be would
    never be read, and both sides would wait until their deadlines. (The cap is lowered here
    to keep the model small: at 64 MiB it takes some 700,000 tensors.)"""
    from aiowsync._sending import handshake

    monkeypatch.setattr(handshake, "MAX_FRAME", 256 * 1024)
    many = {f"layers.{i:05d}.experts.down_projection.weight": torch.zeros(1) for i in range(4000)}
    message = r"a model of 4000 tensors is described in [0-9.]+ MiB, more than a control message"
    with pytest.raises(ValueError, match=message):
        aiowsync.SharedMemWeightSyncScheme().init_on_sender(weights=many, num_workers=1)
    r = aiowsync.SharedMemWeightSyncScheme(address="ipc://@unused")
    with pytest.raises(ValueError, match=message):
        r.init_on_receiver(weights=many, worker_idx=0)
