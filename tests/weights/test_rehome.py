"""Re-homing a module onto flat buffers, and flattening weight containers (TensorDicts) to named
tensors."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import aiowsync
from aiowsync import Layout
from aiowsync._copy.engine import CopyPolicy
from aiowsync._weights.binding import bind_views, is_homed, module_targets, rehome
from aiowsync._weights.flatten import flatten_weights
from helpers import Mixed, buffer_of, same

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
    assert same({k: t.detach() for k, t in targets.items()}, before)
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
    assert same({k: t.detach() for k, t in module_targets(model).items()}, before)


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


def test_flattening_a_tensordict_walks_its_entries_and_falls_back_for_other_kinds() -> None:
    from tensordict import LazyStackedTensorDict

    from aiowsync._weights.flatten import _walk_plain

    inner = TensorDict({"w": torch.randn(3, 2), "deep": {"b": torch.arange(4)}}, [])
    td = TensorDict({"a": inner, "s": torch.tensor(1.5), "p": nn.Parameter(torch.ones(2))}, [])
    walked: dict[str, torch.Tensor] = {}
    leaves = [0]
    assert _walk_plain(td, "", walked, leaves)
    assert list(walked) == ["a.w", "a.deep.b", "s", "p"] and leaves == [4]
    flat = flatten_weights(td)
    assert list(flat) == list(walked)
    assert all(flat[k].data_ptr() == walked[k].data_ptr() for k in flat)
    assert not flat["p"].requires_grad  # detached as before
    # A lazy stack inside: not walked here, flattened through to_dict() as before.
    stack = LazyStackedTensorDict.lazy_stack(
        [TensorDict({"x": torch.zeros(2)}, []), TensorDict({"x": torch.ones(2)}, [])]
    )
    td["stack"] = stack
    assert not _walk_plain(td, "", {}, [0])
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
