"""Layouts: packing named tensors into aligned flat buffers, buckets, fingerprints and checks."""

from __future__ import annotations

import re

import pytest
import torch
from tensordict import TensorDict

import aiowsync
from aiowsync import Layout, TensorSpec
from aiowsync._copy.engine import CopyPolicy
from aiowsync._protocol import PROTOCOL_VERSION, Hello, TensorDesc, decode, encode
from aiowsync._weights.flatten import flatten_weights
from helpers import Mixed, buffer_of, same

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
    assert same(views, source)
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
    assert same(views, source)
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
    assert same(views, source)
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


def test_tensors_that_are_not_dense_are_refused_naming_the_key() -> None:
    dense = {"a": torch.randn(3, 3), "b": torch.randn(4)}
    with pytest.raises(TypeError, match=r"a: a sparse_coo tensor; give it dense"):
        Layout.from_weights({"a": dense["a"].to_sparse(), "b": dense["b"]})
    layout = Layout.from_weights(dense)
    layout.check(dense)
    with pytest.raises(aiowsync.LayoutMismatchError, match=r"a: a sparse_coo tensor; give"):
        layout.check({"a": dense["a"].to_sparse(), "b": dense["b"]})


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated
def test_quantized_tensors_and_colliding_names_are_refused() -> None:
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="b: a quantized tensor, whose scale and zero point"):
        Layout.from_weights({"a": torch.randn(2), "b": quantized})
    # A dotted key beside a nested one of the same name: one tensor would be dropped.
    td = TensorDict({"a.b": torch.ones(3), "a": {"b": torch.zeros(3)}}, [])
    with pytest.raises(ValueError, match=r"weights key 'a\.b' appears twice"):
        flatten_weights(td)
