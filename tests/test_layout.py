"""Layouts: packing named tensors into aligned flat buffers, checks, and re-homing a module."""

from __future__ import annotations

import array
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import aiowsync
from aiowsync import Layout, TensorSpec, _copy
from aiowsync._copy.engine import CopyPolicy, fused_copy, streams_available
from aiowsync._copy.gather import GatherCopy
from aiowsync._copy.job import (
    EARLY_TAILS,
    MAX_MOVE,
    TAIL,
    CopyJob,
    cut_moves,
    early_share,
    split_sizes,
)
from aiowsync._planes.base import Source, WeightSource
from aiowsync._planes.shm.sender import SharedMemSenderPlane
from aiowsync._protocol import PROTOCOL_VERSION, Hello, TensorDesc, decode, encode
from aiowsync._weights.binding import bind_views, is_homed, module_targets, rehome
from aiowsync._weights.flatten import flatten_weights


class Mixed(nn.Module):
    """Parameters and buffers of every awkward kind the layout must carry."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.bn = nn.BatchNorm1d(3)  # running stats plus an int64 0-d num_batches_tracked
        self.fp16 = nn.Parameter(torch.randn(7, dtype=torch.float16))
        self.brain = nn.Parameter(torch.randn(2, 3, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("codes", torch.tensor([-128, 0, 5, 127], dtype=torch.int8))
        self.register_buffer("scale", torch.tensor(2.5))
        self.register_buffer("nothing", torch.empty(0, 4))
        with torch.no_grad():
            self.bn.running_mean.uniform_()
            self.bn.num_batches_tracked.fill_(11)


@pytest.fixture(params=["streamed", "plain"])
def policy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyPolicy]:
    """Run a copy test with non-temporal copies (where built) and with plain ones. The policy
    is also the process's default for the test, for what copies without one (``Layout.pack``,
    ``rehome``)."""
    streamed = request.param == "streamed"
    if streamed and not streams_available():
        pytest.skip("non-temporal copies are not available here")
    made = CopyPolicy(streaming=streamed)
    monkeypatch.setattr(_copy, "_default", made)
    try:
        yield made
    finally:
        made.close()


def gather_pool_or_skip(policy: CopyPolicy) -> None:
    if policy.gather_pool() is None:
        pytest.skip("torch does not run on OpenMP here")


def assert_same_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


def buffer_of(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> int | None:
    """Index of the flat buffer whose memory holds ``tensor``, if any."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for i, buf in enumerate(buffers):
        lo = buf.data_ptr()
        if lo <= start and end <= lo + buf.numel():
            return i
    return None


# -- the table ------------------------------------------------------------------------------


def test_every_kind_of_tensor_is_in_the_layout() -> None:
    model = Mixed()
    layout = Layout.from_weights(model)
    specs = {s.key: s for s in layout.specs}
    assert list(layout.keys) == sorted(specs)
    assert specs["bn.num_batches_tracked"].dtype == torch.int64
    assert specs["bn.num_batches_tracked"].shape == ()
    assert specs["mask"].dtype == torch.bool
    assert specs["codes"].dtype == torch.int8
    assert specs["fp16"].dtype == torch.float16
    assert specs["brain"].dtype == torch.bfloat16
    assert specs["scale"].shape == () and specs["scale"].numel == 1
    assert specs["nothing"].shape == (0, 4) and specs["nothing"].nbytes == 0
    assert specs["linear.weight"].nbytes == 15 * 4
    assert layout.payload_bytes == sum(t.nbytes for t in flatten_weights(model).values())
    assert len(layout) == len(flatten_weights(model)) == 13


@pytest.mark.parametrize("alignment", [1, 8, 64, 256])
def test_offsets_are_aligned_and_do_not_overlap(alignment: int) -> None:
    layout = Layout.from_weights(Mixed(), alignment=alignment)
    assert layout.alignment == alignment
    ends: dict[int, int] = {}
    for spec in layout.specs:
        assert spec.offset % alignment == 0, spec
        assert spec.offset >= ends.get(spec.buffer, 0), f"{spec.key} overlaps its predecessor"
        ends[spec.buffer] = spec.offset + spec.nbytes
    for i, size in enumerate(layout.buffer_sizes):
        assert size % alignment == 0
        assert ends[i] <= size
    assert layout.total_bytes >= layout.payload_bytes


@pytest.mark.parametrize("alignment", [0, -8, 3, 48])
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        Layout([("w", torch.float32, (1,))], alignment=alignment)


def test_invalid_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate key 'w'"):
        Layout([("w", torch.float32, (1,)), ("w", torch.int64, (2,))])
    with pytest.raises(ValueError, match="negative dimension"):
        Layout([("w", torch.float32, (2, -1))])
    with pytest.raises(ValueError, match="bucket_bytes"):
        Layout([("w", torch.float32, (1,))], bucket_bytes=0)


def test_tensor_spec_sizes() -> None:
    assert TensorSpec("s", torch.float64, (), 0, 0).nbytes == 8
    assert TensorSpec("e", torch.float32, (3, 0), 0, 0).nbytes == 0
    assert TensorSpec("b", torch.bfloat16, (2, 5), 0, 64).nbytes == 20
    assert TensorSpec("b", torch.bfloat16, (2, 5), 0, 64).describe() == "bfloat16[2, 5]"


def test_empty_layout() -> None:
    layout = Layout([])
    assert len(layout) == 0
    assert layout.views(layout.allocate()) == {}
    assert len(layout.fingerprint) == 64


# -- packing --------------------------------------------------------------------------------


def test_pack_and_views_round_trip_every_dtype(policy: CopyPolicy) -> None:
    model = Mixed()
    source = flatten_weights(model)
    layout = Layout.from_weights(model)
    buffers = layout.allocate()
    assert [b.numel() for b in buffers] == list(layout.buffer_sizes)
    assert all(b.dtype == torch.uint8 for b in buffers)
    views = layout.views(buffers)
    layout.pack(source, views, policy)
    assert_same_values(views, source)
    for key, view in views.items():
        spec = layout.specs[layout.keys.index(key)]
        if view.numel():
            assert buffer_of(view, buffers) == spec.buffer
            assert view.data_ptr() - buffers[spec.buffer].data_ptr() == spec.offset
    # the views really are the buffer: changing bytes changes the typed values
    buffers[0].zero_()
    assert not views["codes"].any()
    assert not views["mask"].any()


def test_non_contiguous_sources_are_packed_by_value() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sources = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "column": base[:, 4],
        "expanded": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),
        "negative_step_free_flip": base.flip(0)[1:4],
        "permuted": torch.arange(24, dtype=torch.int16).reshape(2, 3, 4).permute(2, 0, 1),
    }
    assert not any(t.is_contiguous() for k, t in sources.items() if k != "negative_step_free_flip")
    layout = Layout.from_weights(sources)
    views = layout.views(layout.allocate())
    layout.pack(sources, views)
    for key, src in sources.items():
        assert views[key].is_contiguous()
        assert views[key].shape == src.shape
        assert torch.equal(views[key], src), key
    # the bytes in the buffer are the row-major order of the values, not the source's memory
    assert views["transposed"].flatten().tolist() == base.t().flatten().tolist()


def test_views_check_their_buffers() -> None:
    layout = Layout.from_weights({"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int64)})
    good = layout.allocate()
    with pytest.raises(ValueError, match="expected 1 buffers"):
        layout.views(good + good)
    with pytest.raises(ValueError, match="1-D uint8"):
        layout.views([torch.zeros(layout.total_bytes // 4, dtype=torch.float32)])
    with pytest.raises(ValueError, match="1-D uint8"):
        layout.views([torch.zeros(layout.total_bytes - 1, dtype=torch.uint8)])
    bigger = [torch.zeros(layout.total_bytes + 100, dtype=torch.uint8)]
    assert set(layout.views(bigger)) == {"a", "b"}


def test_thousand_tensor_round_trip(policy: CopyPolicy) -> None:
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]
    source: dict[str, torch.Tensor] = {}
    for i in range(1000):
        shape = tuple(int(d) for d in torch.randint(0, 5, (i % 4,), generator=gen))
        dtype = dtypes[i % len(dtypes)]
        values = torch.randint(-100, 100, shape, generator=gen)
        source[f"block{i // 10}.t{i % 10}"] = (
            (values > 0) if dtype is torch.bool else values.to(dtype)
        )
    layout = Layout.from_weights(source, bucket_bytes=4096)
    assert len(layout) == 1000
    assert len(layout.buffer_sizes) > 1
    views = layout.views(layout.allocate())
    layout.pack(source, views, policy)
    assert_same_values(views, source)
    again = Layout.from_descs(decode(encode(hello_for(layout))).layout)  # type: ignore[union-attr]
    assert again.fingerprint == layout.fingerprint


# -- buckets --------------------------------------------------------------------------------


def test_bucket_bytes_splits_into_several_buffers() -> None:
    source = {f"w{i:02d}": torch.full((250,), float(i)) for i in range(10)}  # 1000 bytes each
    source["big"] = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: bigger than a bucket
    layout = Layout.from_weights(source, bucket_bytes=2048)
    assert len(layout.buffer_sizes) >= 6
    for spec in layout.specs:
        if spec.key != "big":
            assert spec.offset + spec.nbytes <= 2048, spec
    big = next(s for s in layout.specs if s.key == "big")
    assert big.offset == 0
    assert sum(1 for s in layout.specs if s.buffer == big.buffer) == 1
    buffers = layout.allocate()
    views = layout.views(buffers)
    layout.pack(source, views)
    assert_same_values(views, source)
    for spec in layout.specs:
        assert buffer_of(views[spec.key], buffers) == spec.buffer
    # bucketing changes where tensors live, not what the model is
    assert layout.fingerprint == Layout.from_weights(source).fingerprint


# -- identity -------------------------------------------------------------------------------


def hello_for(layout: Layout) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION,
        model_id="m",
        worker_idx=0,
        fingerprint=layout.fingerprint,
        layout=layout.descs(),
    )


def test_module_tensordict_and_state_dict_give_the_same_fingerprint() -> None:
    model = Mixed()
    from_module = Layout.from_weights(model)
    from_td = Layout.from_weights(TensorDict.from_module(model))
    from_sd = Layout.from_weights(model.state_dict())
    nested = Layout.from_weights({"linear": {"weight": torch.zeros(3, 5)}, "other": torch.ones(1)})
    assert from_module.fingerprint == from_td.fingerprint == from_sd.fingerprint
    assert from_module == from_td == from_sd
    assert re.fullmatch(r"[0-9a-f]{64}", from_module.fingerprint)
    assert nested.keys == ("linear.weight", "other")
    # the handshake form rebuilds the same layout, offsets included
    rebuilt = Layout.from_descs(from_module.descs())
    assert rebuilt.fingerprint == from_module.fingerprint
    assert rebuilt.specs == from_module.specs
    assert decode(encode(hello_for(from_module))) == hello_for(from_module)


def test_fingerprint_changes_with_key_shape_or_dtype() -> None:
    base = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}
    variants = [
        {"a": torch.zeros(3, 2), "b": base["b"]},
        {"a": torch.zeros(2, 3, dtype=torch.float64), "b": base["b"]},
        {"a2": base["a"], "b": base["b"]},
        {"a": base["a"]},
    ]
    fingerprints = {Layout.from_weights(base).fingerprint}
    fingerprints |= {Layout.from_weights(v).fingerprint for v in variants}
    assert len(fingerprints) == 1 + len(variants)


def test_unknown_dtype_in_descs_is_refused() -> None:
    with pytest.raises(aiowsync.LayoutMismatchError, match="unknown dtype"):
        Layout.from_descs([TensorDesc("w", "float99", (1,))])
    with pytest.raises(aiowsync.LayoutMismatchError):
        Layout.from_descs([TensorDesc("w", "nn", (1,))])  # torch.nn exists but is no dtype


# -- checks ---------------------------------------------------------------------------------


def expected() -> dict[str, torch.Tensor]:
    return {
        "enc.weight": torch.zeros(4, 3),
        "enc.bias": torch.zeros(4),
        "head.weight": torch.zeros(2, 4),
        "steps": torch.zeros((), dtype=torch.int64),
    }


def test_check_names_every_difference() -> None:
    layout = Layout.from_weights(expected())
    layout.check(expected())  # the same weights pass
    given = expected()
    given["enc.weight"] = torch.zeros(3, 4)  # shape
    given["steps"] = torch.zeros((), dtype=torch.int32)  # dtype
    del given["head.weight"]  # missing
    given["extra.bias"] = torch.zeros(1)  # unexpected; same count as the layout
    with pytest.raises(aiowsync.LayoutMismatchError) as info:
        layout.check(given)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, aiowsync.WeightSyncError)
    text = str(err)
    assert "enc.weight: expected float32[4, 3], got float32[3, 4]" in text
    assert "steps: expected int64[], got int32[]" in text
    assert "head.weight: missing" in text
    assert "extra.bias: unexpected key" in text
    assert "enc.bias" not in text
    assert len(err.differences) == 4


def test_check_compatible_names_every_difference() -> None:
    mine = Layout.from_weights(expected())
    theirs_weights = expected()
    theirs_weights["head.weight"] = torch.zeros(2, 5)
    theirs_weights["enc.bias"] = torch.zeros(4, dtype=torch.float16)
    del theirs_weights["steps"]
    theirs_weights["decoder.weight"] = torch.zeros(1)
    theirs = Layout.from_weights(theirs_weights)
    mine.check_compatible(Layout.from_weights(expected()))
    with pytest.raises(aiowsync.LayoutMismatchError) as info:
        mine.check_compatible(theirs, context="receiver model")
    text = str(info.value)
    assert text.startswith("receiver model do not match")
    assert "head.weight: expected float32[2, 4], got float32[2, 5]" in text
    assert "enc.bias: expected float32[4], got float16[4]" in text
    assert "steps: missing (expected int64[])" in text
    assert "decoder.weight: unexpected key (float32[1])" in text
    assert "enc.weight" not in text
    assert mine.differences(theirs) == list(info.value.differences)


# -- re-homing a module ---------------------------------------------------------------------


def test_rehome_keeps_identity_values_and_optimizer() -> None:
    torch.manual_seed(0)
    model = Mixed()
    params = dict(model.named_parameters())
    before = {k: t.detach().clone() for k, t in module_targets(model).items()}
    float_params = [p for p in model.parameters() if p.dtype == torch.float32]
    opt = torch.optim.SGD(float_params, lr=0.5)
    layout = Layout.from_weights(model)
    buffers = rehome(model, layout)

    targets = module_targets(model)
    assert all(params[k] is p for k, p in model.named_parameters())
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in params.values())
    assert_same_values({k: t.detach() for k, t in targets.items()}, before)
    views = layout.views(buffers)
    assert is_homed(targets, views)
    for key, t in targets.items():
        if t.numel():
            assert buffer_of(t, buffers) is not None, key

    # the optimizer built before re-homing now writes into the flat buffer
    model.linear.weight.grad = torch.ones_like(model.linear.weight)
    model.linear.bias.grad = torch.ones_like(model.linear.bias)
    for p in float_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(views["linear.weight"], before["linear.weight"] - 0.5)
    assert torch.equal(model.linear.weight.detach(), views["linear.weight"])
    assert is_homed(module_targets(model), views)

    # and a forward pass still works on the re-homed parameters
    model.eval()
    out = model.bn(model.linear(torch.ones(2, 5)))
    assert out.shape == (2, 3)


def test_is_homed_turns_false_after_a_data_reassignment() -> None:
    model = nn.Linear(4, 2)
    layout = Layout.from_weights(model)
    views = layout.views(rehome(model, layout))
    assert is_homed(module_targets(model), views)
    model.weight.data = model.weight.data.clone()
    assert not is_homed(module_targets(model), views)
    assert torch.equal(model.weight.detach(), views["weight"])  # same values, other memory


def test_is_homed_needs_every_key() -> None:
    model = nn.Linear(4, 2)
    layout = Layout.from_weights(model)
    views = layout.views(rehome(model, layout))
    targets = module_targets(model)
    assert not is_homed({"weight": targets["weight"]}, views)
    assert not is_homed(targets, {"weight": views["weight"]})


def test_rehome_refuses_a_module_of_another_layout() -> None:
    with pytest.raises(aiowsync.LayoutMismatchError, match="weight"):
        rehome(nn.Linear(4, 2), Layout.from_weights(nn.Linear(2, 4)))


def test_bind_views_points_tensors_at_new_memory_without_copying() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    weight = model[0].weight
    layout = Layout.from_weights(model)
    buffers = layout.allocate()
    views = layout.views(buffers)
    for i, v in enumerate(views.values()):
        v.fill_(i + 1)
    bind_views(module_targets(model), views)
    assert model[0].weight is weight
    for key, t in module_targets(model).items():
        assert t.data_ptr() == views[key].data_ptr(), key
        assert torch.equal(t.detach(), views[key])
    buffers[0].zero_()  # writing the buffer is writing the model
    assert not model[0].weight.detach().any()
    assert model[1].num_batches_tracked.item() == 0


def test_rehome_a_thousand_parameter_model(policy: CopyPolicy) -> None:
    torch.manual_seed(1)
    model = nn.ModuleList(nn.Linear(2, 2) for _ in range(500))
    assert len(module_targets(model)) == 1000
    before = {k: t.detach().clone() for k, t in module_targets(model).items()}
    layout = Layout.from_weights(model)
    buffers = rehome(model, layout, policy)
    assert len(buffers) == 1
    assert is_homed(module_targets(model), layout.views(buffers))
    assert_same_values({k: t.detach() for k, t in module_targets(model).items()}, before)


def test_tied_weights_stay_tied() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(6, 4)
            self.out = nn.Linear(4, 6, bias=False)
            self.out.weight = self.embed.weight

    model = Tied()
    shared = model.embed.weight
    layout = Layout.from_weights(model)
    assert layout.keys == ("embed.weight",)  # one tensor, stored once
    views = layout.views(rehome(model, layout))
    assert model.out.weight is model.embed.weight is shared
    assert model.out.weight.data_ptr() == views["embed.weight"].data_ptr()
    views["embed.weight"].fill_(3.0)
    assert torch.equal(model.out(torch.ones(1, 4)), torch.full((1, 6), 12.0))


def test_fused_copy_of_a_large_mixed_list_copies_every_byte(policy: CopyPolicy) -> None:
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.float16]
    src: list[torch.Tensor] = []
    for i in range(300):
        n = int(torch.randint(1, 20000, (1,), generator=g))
        t = (torch.randn(n, generator=g) * 100).to(dtypes[i % len(dtypes)])
        src.append(t)
    src.append(torch.randn(64, 32, generator=g).t())  # non-contiguous goes through torch
    dst = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in src]
    assert sum(t.nbytes for t in dst) > 4 * 1024 * 1024  # large enough for the threaded path
    fused_copy(dst, src, policy)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


def test_a_closed_policy_still_copies_every_byte_in_the_callers_thread() -> None:
    # A plane that closes while a send stages shuts its helper threads down under that copy:
    # the copy must still end whole, with no new threads started for it.
    policy = CopyPolicy()
    src = [torch.randn(3 * 1024 * 1024) for _ in range(3)]
    dst = [torch.empty_like(t) for t in src]
    fused_copy(dst, src, policy)
    policy.close()
    for t in src:
        t.add_(1.0)
    fused_copy(dst, src, policy)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert policy.gather_pool() is None


def test_a_job_whose_helpers_cannot_start_is_finished_by_its_caller() -> None:
    done: list[int] = []
    job = CopyJob([0, 1], [2, 3], done.append)
    shut = ThreadPoolExecutor(max_workers=1)
    shut.shutdown()
    job.start(shut)
    job.finish()
    assert sorted(done) == [0, 1, 2, 3]


def _mixed_weights(seed: int, count: int = 400) -> dict[str, torch.Tensor]:
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


@pytest.mark.parametrize("bucket_bytes", [None, 2 * 1024 * 1024])
def test_gather_copy_fills_every_tensor_and_reuses_its_plan(
    bucket_bytes: int | None, policy: CopyPolicy
) -> None:
    gather_pool_or_skip(policy)
    weights = _mixed_weights(1)
    layout = Layout.from_weights(weights, bucket_bytes=bucket_bytes)
    assert layout.total_bytes > 4 * 1024 * 1024
    gather = GatherCopy(layout, policy)
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
    weights = _mixed_weights(2, count=60)
    layout = Layout.from_weights(weights)
    gather = GatherCopy(layout)
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
    assert not GatherCopy(lay_c).copy(lay_c.allocate(), src_c)
    # Small models are not worth the threads.
    small = {"a": torch.ones(10)}
    lay_s = Layout.from_weights(small)
    assert not GatherCopy(lay_s).copy(lay_s.allocate(), [small["a"]])
    assert all(torch.equal(b, torch.zeros_like(b)) for b in dst)


@pytest.mark.parametrize("early", [0.0, 0.01, 0.5, 2.0])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("total", [4 << 20, (64 << 20) + 70, 1 << 30])
def test_a_parallel_copy_is_cut_into_pieces_that_cover_every_byte_once(
    threads: int, total: int, early: float
) -> None:
    heads, tails = split_sizes(total, threads, early)
    assert sum(heads) + sum(tails) == total
    assert len(tails) in (0, threads - 1) and all(n > 0 for n in heads + tails)
    usual = TAIL * (threads - 1) / threads
    if tails:
        # Started before a check: the tails take the check's expected share of the copy, up
        # to EARLY_TAILS, and never less than usual.
        want = max(usual, min(early, EARLY_TAILS))
        assert sum(tails) == pytest.approx(want * total, rel=1e-3)
    # Moves laid end to end (sources far from destinations), cut into those groups.
    sizes = [total // 3, 5, total - total // 3 - 5]
    moves, at = [], 0
    for n in sizes:
        moves.append((at, (1 << 40) + at, n))
        at += n
    groups = cut_moves(moves, heads + tails)
    assert len(groups) == len(heads) + len(tails)
    flat = [m for g in groups for m in g]
    assert all(0 < n <= MAX_MOVE and s - d == 1 << 40 for d, s, n in flat)
    covered = 0
    for d, _, n in flat:  # in order, no gap, no overlap
        assert d == covered
        covered += n
    assert covered == total
    assert [sum(n for _, _, n in g) for g in groups] == heads + tails


def test_a_copy_job_abandoned_stops_taking_pieces() -> None:
    import time
    from concurrent.futures import ThreadPoolExecutor

    done: list[int] = []
    jobs: list[CopyJob[int]] = []

    def run(piece: int) -> None:
        if piece == -1:  # the helper's tail: it ends only once the job is abandoned
            deadline = time.monotonic() + 5
            while not jobs[0]._stopped and time.monotonic() < deadline:
                time.sleep(0.001)
        done.append(piece)

    with ThreadPoolExecutor(1) as pool:
        jobs.append(CopyJob(list(range(100)), [-1], run))
        jobs[0].start(pool, settle=1.0)
        jobs[0].abandon()
        assert done == [-1]  # the tail ends; no piece of the head is begun
        # finish() copies everything, the calling thread included.
        done.clear()
        job = CopyJob(list(range(100)), [-1], done.append)
        job.start(pool)
        job.finish()
        assert sorted(done) == [-1, *range(100)]


def test_gather_copy_started_early_is_kept_for_the_same_sources_and_redone_otherwise(
    policy: CopyPolicy,
) -> None:
    gather_pool_or_skip(policy)
    weights = _mixed_weights(4)
    layout = Layout.from_weights(weights)
    gather = GatherCopy(layout, policy)
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
    first = _mixed_weights(5)
    layout = Layout.from_weights(first)
    second = {k: t.clone() for k, t in first.items()}
    gather = GatherCopy(layout, policy)
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
    gather.clear()
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

    weights = _mixed_weights(6, count=40)
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

    def spy(dst: list[torch.Tensor], hint: object = None) -> object:
        early = real_start(dst, hint)
        if early is not None:
            started.append(str(hint))
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
        assert plane._last["homed"] is not None and plane._last["weights"] is None
        assert views  # the homed views stay valid
    finally:
        plane.close()


def test_helpers_are_woken_away_from_the_callers_cpu_and_take_its_cpus_back() -> None:
    import os
    import threading

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and two CPUs")
    cpus = os.sched_getaffinity(0)
    src = torch.randn(3 << 20)  # 12 MiB: copied by this thread and a helper
    dst = torch.zeros_like(src)
    policy = CopyPolicy()
    others = set(threading.enumerate())
    fused_copy([dst], [src], policy)
    assert torch.equal(dst, src)
    helpers = [t for t in set(threading.enumerate()) - others if t.name.startswith("aiowsync-copy")]
    assert helpers
    assert policy.steer_helpers() == cpus
    for t in helpers:
        assert t.native_id is not None
        mask = os.sched_getaffinity(t.native_id)
        assert mask < cpus and len(mask) == len(cpus) - 1  # all but the caller's CPU
    src.add_(1)
    fused_copy([dst], [src], policy)  # a helper takes its share, and its CPUs back
    assert torch.equal(dst, src)
    ran = [t for t in helpers if t.native_id and os.sched_getaffinity(t.native_id) == cpus]
    assert ran
    policy.close()
    assert not any(t.is_alive() for t in helpers)


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


def test_flattening_a_tensordict_walks_its_entries_and_falls_back_for_other_kinds() -> None:
    from tensordict import LazyStackedTensorDict

    from aiowsync._weights.flatten import _walk_plain

    inner = TensorDict({"w": torch.randn(3, 2), "deep": {"b": torch.arange(4)}}, [])
    td = TensorDict({"a": inner, "s": torch.tensor(1.5), "p": nn.Parameter(torch.ones(2))}, [])
    walked: dict[str, torch.Tensor] = {}
    assert _walk_plain(td, "", walked)
    assert list(walked) == ["a.w", "a.deep.b", "s", "p"]
    flat = flatten_weights(td)
    assert list(flat) == list(walked)
    assert all(flat[k].data_ptr() == walked[k].data_ptr() for k in flat)
    assert not flat["p"].requires_grad  # detached as before
    # A lazy stack inside: not walked here, flattened through to_dict() as before.
    stack = LazyStackedTensorDict.lazy_stack(
        [TensorDict({"x": torch.zeros(2)}, []), TensorDict({"x": torch.ones(2)}, [])]
    )
    td["stack"] = stack
    assert not _walk_plain(td, "", {})
    flat = flatten_weights(td)
    assert list(flat) == ["a.w", "a.deep.b", "s", "p", "stack.x"]
    assert torch.equal(flat["stack.x"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_flattening_a_tensordict_names_nested_leaves_and_refuses_non_tensors() -> None:
    grad = torch.ones(3, requires_grad=True)
    td = TensorDict({"a": {"b": torch.zeros(2), "c": {"d": grad}}, "e": torch.ones(1)}, [])
    flat = flatten_weights(td)
    assert list(flat) == ["a.b", "a.c.d", "e"]
    assert not flat["a.c.d"].requires_grad and flat["a.c.d"].data_ptr() == grad.data_ptr()
    assert flat["e"] is td["e"]
    td["a", "note"] = "not weights"
    with pytest.raises(TypeError, match=r"'a\.note' is a .*, not a tensor"):
        flatten_weights(td)


def test_the_early_share_follows_what_the_check_is_expected_to_cost() -> None:
    mib = 1 << 20
    # A thousand tensors in 64 MiB: the check may outlast half the copy, the tails take the most.
    many = early_share(1000, 64 * mib)
    assert many > EARLY_TAILS
    heads, tails = split_sizes(64 * mib, 2, many)
    assert sum(tails) == pytest.approx(EARLY_TAILS * 64 * mib, rel=1e-3)
    # Four tensors in 256 MiB check in microseconds: cut as a copy started after the check.
    few = early_share(4, 256 * mib)
    assert few < 0.01
    assert split_sizes(256 * mib, 2, few) == split_sizes(256 * mib, 2)
    assert sum(split_sizes(256 * mib, 2, few)[1]) == pytest.approx(TAIL / 2 * 256 * mib, 1e-3)
    assert early_share(10, 0) == 0.0


def _share_bytes(share: object) -> int:
    """Bytes one thread's share of a gather copy fills, plain or packed."""
    if isinstance(share, array.array):
        return sum(share[2::3])  # packed (dst, src, nbytes) moves
    assert isinstance(share, list)
    return sum(out.numel() for _, out in share)


def test_a_gather_copy_started_early_cuts_by_its_layout(policy: CopyPolicy) -> None:
    few = {f"w{i}": torch.randn(1 << 20) for i in range(4)}  # 16 MiB in 4 tensors
    lay = Layout.from_weights(few)
    gather = GatherCopy(lay, policy)
    dst = lay.allocate()
    src = [few[k] for k in lay.keys]
    hint = "model"
    assert gather.copy(dst, src, keep=True, hint=hint)
    early = gather.start(dst, hint)
    assert early is not None
    try:
        # the helper's tail is the usual one: the check of four tensors takes no time
        usual_tails = split_sizes(lay.total_bytes, gather._plans[early.key]._threads)[1]
        tail_bytes = sum(map(_share_bytes, early.job._tails))
        assert tail_bytes == sum(usual_tails)
        assert tail_bytes < EARLY_TAILS * lay.total_bytes
    finally:
        assert gather.copy(dst, src, early=early, hint=hint)
    for spec in lay.specs:
        got = dst[spec.buffer][spec.offset : spec.offset + spec.nbytes].view(torch.float32)
        assert torch.equal(got, few[spec.key])
