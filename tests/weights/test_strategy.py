"""Weight strategies: extraction in both formats and application in and out of place."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

import aiowsync
from aiowsync import WeightStrategy


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].running_mean.uniform_()
        model[1].num_batches_tracked.fill_(seed + 1)
    return model


KEYS = {
    "0.weight",
    "0.bias",
    "1.weight",
    "1.bias",
    "1.running_mean",
    "1.running_var",
    "1.num_batches_tracked",
    "2.weight",
    "2.bias",
}


def flat(weights: Any) -> dict[str, torch.Tensor]:
    if isinstance(weights, nn.Module):
        return {k: v.detach() for k, v in weights.state_dict(keep_vars=True).items()}
    if isinstance(weights, TensorDictBase):
        return dict(weights.flatten_keys(".").items())
    return dict(weights)


def snapshot(weights: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in flat(weights).items()}


def assert_values(actual: Any, expected: Any) -> None:
    a, b = flat(actual), flat(expected)
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def identities(weights: Any) -> dict[str, int]:
    if isinstance(weights, nn.Module):
        return {k: id(v) for k, v in weights.state_dict(keep_vars=True).items()}
    return {k: id(v) for k, v in flat(weights).items()}


# -- construction ---------------------------------------------------------------------------


def test_default_strategy_is_tensordict() -> None:
    assert WeightStrategy().extract_as == "tensordict"
    assert repr(WeightStrategy("state_dict")) == "WeightStrategy(extract_as='state_dict')"


@pytest.mark.parametrize("name", ["pickle", "TensorDict", "", None])
def test_invalid_extract_as_raises_value_error(name: Any) -> None:
    with pytest.raises(ValueError, match="extract_as"):
        WeightStrategy(name)


# -- extraction -----------------------------------------------------------------------------


def sources() -> list[tuple[str, Any]]:
    model = make_model()
    return [
        ("module", model),
        ("tensordict", TensorDict.from_module(model)),
        ("state_dict", model.state_dict()),
    ]


@pytest.mark.parametrize("kind", ["module", "tensordict", "state_dict"])
def test_extract_as_tensordict(kind: str) -> None:
    source = dict(sources())[kind]
    out = WeightStrategy("tensordict").extract_weights(source)
    assert isinstance(out, TensorDictBase)
    assert out.batch_size == torch.Size([])
    assert set(out.keys(include_nested=True, leaves_only=True)) == {
        tuple(k.split(".")) for k in KEYS
    }
    assert_values(out, make_model())
    assert out["1", "num_batches_tracked"].dtype == torch.int64
    # nothing is copied: the result shares memory with the source
    assert out["0", "weight"].data_ptr() == flat(source)["0.weight"].data_ptr()


@pytest.mark.parametrize("kind", ["module", "tensordict", "state_dict"])
def test_extract_as_state_dict(kind: str) -> None:
    source = dict(sources())[kind]
    out = WeightStrategy("state_dict").extract_weights(source)
    assert type(out) is dict
    assert set(out) == KEYS
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in out.values())
    assert_values(out, make_model())
    assert out["2.bias"].data_ptr() == flat(source)["2.bias"].data_ptr()


def test_extract_tensordict_from_a_tensordict_is_the_same_object() -> None:
    td = TensorDict.from_module(make_model())
    assert WeightStrategy().extract_weights(td) is td


def test_extract_flattens_nested_state_dicts() -> None:
    nested = {"enc": {"w": torch.ones(2), "deep": {"b": torch.zeros(1)}}, "head": torch.ones(3)}
    assert set(WeightStrategy("state_dict").extract_weights(nested)) == {
        "enc.w",
        "enc.deep.b",
        "head",
    }
    td = WeightStrategy().extract_weights(nested)
    assert isinstance(td, TensorDictBase)
    assert torch.equal(td["enc", "deep", "b"], torch.zeros(1))


@pytest.mark.parametrize("bad", [[torch.ones(1)], torch.ones(3), "weights", 42, None])
def test_extract_from_an_unsupported_type_raises_type_error(bad: Any) -> None:
    for name in ("tensordict", "state_dict"):
        with pytest.raises(TypeError):
            WeightStrategy(name).extract_weights(bad)  # type: ignore[arg-type]


def test_extract_refuses_non_tensor_entries() -> None:
    with pytest.raises(TypeError, match="not a tensor"):
        WeightStrategy("state_dict").extract_weights({"w": [1.0, 2.0]})
    with pytest.raises(TypeError, match="keys"):
        WeightStrategy("state_dict").extract_weights({1: torch.ones(1)})


# -- in-place application -------------------------------------------------------------------


def new_weights(form: str) -> Any:
    source = make_model(seed=7)
    if form == "module":
        return source
    if form == "tensordict":
        return TensorDict.from_module(source)
    return source.state_dict()


@pytest.mark.parametrize("form", ["module", "tensordict", "state_dict"])
@pytest.mark.parametrize("dest_kind", ["module", "tensordict", "state_dict"])
def test_apply_in_place_keeps_tensors_and_changes_values(form: str, dest_kind: str) -> None:
    model = make_model()
    destination: Any = {
        "module": model,
        "tensordict": TensorDict.from_module(model),
        "state_dict": model.state_dict(),
    }[dest_kind]
    ids_before = identities(destination)
    ptrs_before = {k: v.data_ptr() for k, v in flat(destination).items()}
    params_before = list(model.parameters())
    WeightStrategy().apply_weights(destination, new_weights(form), inplace=True)
    assert identities(destination) == ids_before
    assert {k: v.data_ptr() for k, v in flat(destination).items()} == ptrs_before
    assert_values(destination, make_model(seed=7))
    # every kind of destination here shares memory with ``model``, which therefore changed too
    assert all(a is b for a, b in zip(model.parameters(), params_before, strict=True))
    assert_values(model, make_model(seed=7))
    assert model[1].num_batches_tracked.item() == 8


def test_apply_in_place_is_the_default() -> None:
    model = make_model()
    weight = model[0].weight
    WeightStrategy().apply_weights(model, new_weights("state_dict"))
    assert model[0].weight is weight
    assert_values(model, make_model(seed=7))


def test_apply_in_place_accepts_non_contiguous_weights() -> None:
    model = nn.Linear(3, 3, bias=False)
    source = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    WeightStrategy().apply_weights(model, {"weight": source.t()})
    assert torch.equal(model.weight.detach(), source.t())


# -- out-of-place application ---------------------------------------------------------------


def test_apply_out_of_place_to_a_module_uses_the_given_tensors() -> None:
    model = make_model()
    old_weight = model[0].weight
    weights = new_weights("state_dict")
    WeightStrategy().apply_weights(model, weights, inplace=False)
    assert_values(model, make_model(seed=7))
    assert model[0].weight is not old_weight
    assert model[0].weight.data_ptr() == weights["0.weight"].data_ptr()
    assert model[1].running_mean.data_ptr() == weights["1.running_mean"].data_ptr()
    assert not torch.equal(old_weight.detach(), model[0].weight.detach())
    out = model.eval()(torch.ones(2, 3))
    assert out.shape == (2, 2)


def test_apply_out_of_place_to_a_tensordict_replaces_entries() -> None:
    model = make_model()
    td = TensorDict.from_module(model)
    old = td["2", "weight"]
    weights = new_weights("tensordict")
    WeightStrategy("state_dict").apply_weights(td, weights, inplace=False)
    assert_values(td, make_model(seed=7))
    assert td["2", "weight"].data_ptr() == weights["2", "weight"].data_ptr()
    assert td["2", "weight"].data_ptr() != old.data_ptr()
    assert_values(model, make_model())  # the module the TensorDict came from is untouched


def test_apply_out_of_place_to_a_dict_raises_value_error() -> None:
    destination = make_model().state_dict()
    before = snapshot(destination)
    with pytest.raises(ValueError, match="in place"):
        WeightStrategy().apply_weights(destination, new_weights("state_dict"), inplace=False)
    assert_values(destination, before)


# -- mismatches are caught before any byte is written ---------------------------------------


def mismatched_weights() -> dict[str, torch.Tensor]:
    weights = new_weights("state_dict")
    weights["0.weight"] = torch.zeros(3, 4)  # transposed shape
    weights["1.num_batches_tracked"] = torch.zeros((), dtype=torch.int32)  # dtype
    del weights["2.bias"]  # missing
    weights["3.weight"] = torch.zeros(1)  # unexpected
    return weights


def destinations() -> list[tuple[str, Any]]:
    model = make_model()
    return [
        ("module", model),
        ("tensordict", TensorDict.from_module(make_model())),
        ("state_dict", make_model().state_dict()),
    ]


@pytest.mark.parametrize(
    ("dest_kind", "inplace"),
    [
        ("module", True),
        ("module", False),
        ("tensordict", True),
        ("tensordict", False),
        ("state_dict", True),  # a state_dict is only ever updated in place
    ],
)
def test_mismatch_names_every_key_and_writes_nothing(dest_kind: str, inplace: bool) -> None:
    destination = dict(destinations())[dest_kind]
    before = snapshot(destination)
    ids_before = identities(destination)
    with pytest.raises(aiowsync.LayoutMismatchError) as info:
        WeightStrategy().apply_weights(destination, mismatched_weights(), inplace=inplace)
    assert isinstance(info.value, ValueError)
    text = str(info.value)
    for key in ("0.weight", "1.num_batches_tracked", "2.bias", "3.weight"):
        assert key in text
    assert "[3, 4]" in text and "int32" in text
    assert len(info.value.differences) == 4
    assert_values(destination, before)
    assert identities(destination) == ids_before


def test_unsupported_destination_raises_type_error() -> None:
    for bad in ([torch.ones(1)], torch.ones(3), "model", None):
        with pytest.raises(TypeError, match="destination"):
            WeightStrategy().apply_weights(bad, {"w": torch.ones(1)})


def test_unsupported_weights_raise_type_error_and_write_nothing() -> None:
    model = make_model()
    before = snapshot(model)
    for bad in ([torch.ones(1)], torch.ones(3), 3.0):
        with pytest.raises(TypeError):
            WeightStrategy().apply_weights(model, bad)
    assert_values(model, before)


@pytest.mark.parametrize("how", ["model", "weights"])
def test_scheme_extracts_the_weights_of_a_tensordict_it_was_given(how: str) -> None:
    td = TensorDict({"w": torch.arange(4.0), "b": torch.ones(2)}, batch_size=[])
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(**{how: td}, num_workers=1)  # type: ignore[arg-type]
    out = scheme.extract_weights()
    assert torch.equal(out["w"], torch.arange(4.0)) and torch.equal(out["b"], torch.ones(2))
