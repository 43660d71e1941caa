"""The benchmark's models, and how a process fills, stamps and reads them.

Every contender (aiowsync, the raw limits, TorchRL) sends the same models, built in every
process from the same :data:`Spec`:

* ``1MiB`` ... ``1GiB``: four float32 matrices of 1/2, 1/4, 1/8 and 1/8 of the size;
* ``1000t-64MiB``: 1000 tensors of varied sizes, 64 MiB less 70 bytes in all: a tenth are
  buffers (int64 index tables and scalars, ten of the scalars bool), the rest float32 (weight,
  bias) pairs whose sizes follow a log-normal draw.

A sample fills every element of the sender's tensors with one number ``k`` (``k & 1`` for bool),
so a worker that reads two different numbers in one pass over its model has seen a mix of two
versions (:class:`Reader`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "MIB",
    "MODELS",
    "Reader",
    "SendSources",
    "Spec",
    "build_model",
    "few_large_spec",
    "fill",
    "fingerprint",
    "many_tensors_spec",
    "model_spec",
    "poison_init",
    "random_init",
    "raw_copy_bytes",
    "spec_bytes",
    "stamp",
]

MIB = 1 << 20

# (dotted name, shape, dtype name, is_buffer)
Entry = tuple[str, tuple[int, ...], str, bool]
Spec = list[Entry]


def few_large_spec(total_bytes: int) -> Spec:
    """Four float32 matrices of 1/2, 1/4, 1/8 and 1/8 of ``total_bytes``, 1024 columns each."""
    floats = total_bytes // 4
    if floats % (8 * 1024):
        raise ValueError(f"{total_bytes} bytes is not a multiple of 32 KiB")
    rows = [floats // 2 // 1024, floats // 4 // 1024, floats // 8 // 1024, floats // 8 // 1024]
    names = ["layers.0.weight", "layers.1.weight", "layers.2.weight", "head.weight"]
    return [(n, (r, 1024), "float32", False) for n, r in zip(names, rows, strict=True)]


def many_tensors_spec(total_bytes: int, n_tensors: int = 1000, seed: int = 0) -> Spec:
    """``n_tensors`` tensors of varied sizes adding up to exactly ``total_bytes``.

    One tenth are int64 buffers (half scalars like ``num_batches_tracked``, half index tables of
    up to 64 Ki entries); the rest are float32 (weight, bias) pairs whose weight sizes follow a
    log-normal draw, from a few hundred bytes to a few MiB.
    """
    rng = random.Random(seed)
    n_int = n_tensors // 10
    n_blocks = (n_tensors - n_int) // 2
    if n_int + 2 * n_blocks != n_tensors:
        raise ValueError("n_tensors must make whole (weight, bias) pairs after the int64 tenth")
    spec: Spec = []
    used = 0
    for i in range(n_int):
        shape: tuple[int, ...] = () if i % 2 == 0 else (int(2 ** rng.uniform(0, 16)),)
        spec.append((f"stats.{i}.table", shape, "int64", True))
        used += 8 * (shape[0] if shape else 1)
    biases = [rng.randint(16, 2048) for _ in range(n_blocks)]
    used += 4 * sum(biases)
    rest_floats = (total_bytes - used) // 4
    if (total_bytes - used) % 4:
        raise ValueError("the int64 part left a remainder that float32 cannot fill")
    draws = [rng.lognormvariate(0.0, 1.2) for _ in range(n_blocks)]
    scale = rest_floats / sum(draws)
    weights_used = 0
    for i in range(n_blocks):
        if i < n_blocks - 1:
            rows = rng.choice((16, 32, 64, 128, 256, 512))
            cols = max(1, int(draws[i] * scale * 0.98) // rows)
            wshape: tuple[int, ...] = (rows, cols)
            weights_used += rows * cols
        else:  # the last weight takes what is left, so the model is exactly total_bytes
            remainder = rest_floats - weights_used
            if remainder <= 0:
                raise AssertionError("size draw overshot; change the seed")
            wshape = (remainder,)
        spec.append((f"blocks.{i}.weight", wshape, "float32", False))
        spec.append((f"blocks.{i}.bias", (biases[i],), "float32", False))
    if spec_bytes(spec) != total_bytes:
        raise AssertionError(f"spec has {spec_bytes(spec)} bytes, not {total_bytes}")
    return spec


def _with_bools(spec: Spec, count: int = 10) -> Spec:
    """The first ``count`` int64 scalars of ``spec`` turned into bool buffers."""
    out: Spec = []
    for key, shape, dtype, is_buffer in spec:
        if dtype == "int64" and shape == () and count > 0:
            dtype, count = "bool", count - 1
        out.append((key, shape, dtype, is_buffer))
    return out


MODELS: dict[str, Callable[[], Spec]] = {
    "1MiB": lambda: few_large_spec(1 * MIB),
    "64MiB": lambda: few_large_spec(64 * MIB),
    "256MiB": lambda: few_large_spec(256 * MIB),
    "1GiB": lambda: few_large_spec(1024 * MIB),
    "1000t-64MiB": lambda: _with_bools(many_tensors_spec(64 * MIB)),
}


def model_spec(name: str) -> Spec:
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose among {', '.join(MODELS)}") from None


def spec_bytes(spec: Spec) -> int:
    total = 0
    for _, shape, dtype, _ in spec:
        n = 1
        for d in shape:
            n *= d
        total += n * getattr(torch, dtype).itemsize
    return total


PAGE = 4096


def raw_copy_bytes(nbytes: int) -> int:
    """How many bytes the raw ``copy_`` limit copies for a model of ``nbytes``: rounded up to a
    whole page.

    torch copies a long uint8 tensor with two threads, each taking half of it. When that half
    does not start on a 64-byte boundary (the second thread's vector stores then each span two
    cache lines), the copy slows down, so an odd length such as the 1000-tensor model's makes
    the limit slow by its length alone, which would flatter what is compared with it
    (docs/adr/0046); the page costs at most 4095 bytes more to copy.
    """
    return -(-nbytes // PAGE) * PAGE


def build_model(spec: Spec, init: Callable[[torch.Tensor], None], device: str = "cpu") -> nn.Module:
    """A module holding the spec's tensors under their dotted names; ``init`` fills each one."""
    root = nn.Module()
    with torch.no_grad():
        for name, shape, dtype, is_buffer in spec:
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                child = mod._modules.get(part)
                if child is None:
                    child = nn.Module()
                    mod.add_module(part, child)
                mod = child
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            init(t)
            if is_buffer:
                mod.register_buffer(leaf, t)
            else:
                mod.register_parameter(leaf, nn.Parameter(t))
    return root


def random_init(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.is_floating_point():
        t.uniform_(-1.0, 1.0)
    else:
        t.random_(0, 1 << 20)


def poison_init(t: torch.Tensor) -> None:
    """Write every page (so a private copy kept by mistake would show in the memory numbers)."""
    t.fill_(-7)


def fill(tensors: Iterable[torch.Tensor], k: int) -> None:
    """Every element of every tensor set to ``k`` (``k & 1`` for bool tensors)."""
    with torch.no_grad():
        for t in tensors:
            t.fill_(bool(k & 1) if t.dtype == torch.bool else k)


def fingerprint(model: nn.Module) -> list[tuple[str, float, float]]:
    """First and last element of every tensor, by key: enough to see which version a model runs
    once the sender has stamped those elements."""
    out = []
    for key, t in sorted(model.state_dict().items()):
        flat = t.reshape(-1)
        out.append((key, float(flat[0]), float(flat[-1])))
    return out


def stamp(model: nn.Module, base: int) -> None:
    """Write distinct values into the first and last element of every tensor."""
    with torch.no_grad():
        for i, (_, t) in enumerate(sorted(model.state_dict().items())):
            flat = t.reshape(-1)
            flat[0] = base + i
            flat[-1] = -(base + i)


class Reader:
    """One read is one pass over a model's tensors, like a forward pass: the first and last
    element of each. A read is *mixed* when the numbers it saw are not all one fill value.

    ``tensors`` is called before every read when ``refresh`` is true (a model whose tensors
    are re-pointed by a switch), once otherwise (TorchRL writes into the tensors it was given).
    """

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], refresh: bool) -> None:
        self._tensors = tensors
        self._refresh = refresh
        self._arrays = self._views()

    def _views(self) -> list[Any]:
        return [t.detach().reshape(-1).numpy() for t in self._tensors()]

    def values(self) -> tuple[set[float], set[bool]]:
        if self._refresh:
            self._arrays = self._views()
        nums: set[float] = set()
        bits: set[bool] = set()
        for a in self._arrays:
            pair = (a[0].item(), a[-1].item())
            (bits if a.dtype.kind == "b" else nums).update(pair)
        return nums, bits

    def mixed(self) -> bool:
        nums, bits = self.values()
        if len(nums) > 1 or len(bits) > 1:
            return True
        return bool(nums and bits) and bits != {bool(int(next(iter(nums))) & 1)}


class SendSources:
    """What a benchmark sender sends: its model (``send()``), or a ``TensorDict`` clone of the
    model's weights (``send(weights)``), made on first use."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._weights: Any = None

    @property
    def weights(self) -> Any:
        if self._weights is None:
            from tensordict import TensorDict

            self._weights = TensorDict.from_module(self.module).data.clone()
        return self._weights

    def targets(self, mode: str) -> list[torch.Tensor]:
        """The tensors that ``mode`` sends, in the order a fill writes them."""
        if mode == "send()":
            return list(self.module.state_dict().values())
        return list(self.weights.values(True, True))
