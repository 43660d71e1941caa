"""A CartPole policy that writes its own ``marker`` weight into every frame it acts in, for
the TorchRL adapter tests (importable by the collectors' spawned workers)."""

from __future__ import annotations

import time

import torch
from torch import nn


class Marked(nn.Module):
    """Greedy over a linear layer; also outputs ``marker``, one of its weights, per frame."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.marker = nn.Parameter(torch.zeros(()))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        action = nn.functional.one_hot(self.net(obs).argmax(-1), 2)
        return action, self.marker.expand(obs.shape[:-1]).unsqueeze(-1).clone()


class TwiceMarked(Marked):
    """Reads ``marker``, pauses, then reads ``twin`` (always set to the same value): a
    forward that straddles a switch outputs two different values."""

    def __init__(self) -> None:
        super().__init__()
        self.twin = nn.Parameter(torch.zeros(()))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        first = self.marker.detach().clone()
        time.sleep(0.002)
        second = self.twin.detach().clone()
        action = nn.functional.one_hot(self.net(obs).argmax(-1), 2)
        both = torch.stack([first, second]).expand(*obs.shape[:-1], 2).clone()
        return action, both


class TiedMarked(nn.Module):
    """A policy whose two layers share one weight (as tied embeddings do); outputs that
    weight's first value, read through the second layer, per frame."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2, bias=False)
        self.b = nn.Linear(4, 2, bias=False)
        self.b.weight = self.a.weight

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        action = nn.functional.one_hot(self.a(obs).argmax(-1), 2)
        return action, self.b.weight[0, 0].expand(obs.shape[:-1]).unsqueeze(-1).clone()


def make_env():  # type: ignore[no-untyped-def]
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def marked_policy(marker: float = 0.0):  # type: ignore[no-untyped-def]
    """A policy factory's product: a ``Marked`` policy whose marker starts at ``marker``
    (``functools.partial(marked_policy, 1.0)`` pickles into spawned workers)."""
    from tensordict.nn import TensorDictModule

    module = Marked()
    with torch.no_grad():
        module.marker.fill_(marker)
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action", "marker"])


class MarkerNet(nn.Module):
    """A model of an environment's own (say, a reward or observation model): its forward
    gives its ``marker`` weight once per frame."""

    def __init__(self, marker: float = 0.0) -> None:
        super().__init__()
        self.marker = nn.Parameter(torch.full((), marker))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.marker.detach().expand(obs.shape[:-1]).unsqueeze(-1).clone()


def make_marked_env():  # type: ignore[no-untyped-def]
    """CartPole whose transform runs a ``MarkerNet`` on each observation and writes its output
    as ``env_marker``: a second model in each worker, at ``env.transform.net``."""
    from torchrl.data import Unbounded
    from torchrl.envs import GymEnv, Transform, TransformedEnv

    class MarkObservation(Transform):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(in_keys=["observation"], out_keys=["env_marker"])
            self.net = MarkerNet()

        def _call(self, next_tensordict):  # type: ignore[no-untyped-def]
            return next_tensordict.set("env_marker", self.net(next_tensordict["observation"]))

        def _reset(self, tensordict, tensordict_reset):  # type: ignore[no-untyped-def]
            return self._call(tensordict_reset)

        def transform_observation_spec(self, observation_spec):  # type: ignore[no-untyped-def]
            observation_spec["env_marker"] = Unbounded(shape=(1,), dtype=torch.float32)
            return observation_spec

    return TransformedEnv(GymEnv("CartPole-v1"), MarkObservation())


def low_level_worker(scheme, out, last: int) -> None:  # type: ignore[no-untyped-def]
    """A worker that drives a TorchRL scheme by hand, as TorchRL's own workers do: it reports
    ``(event, version, marker)`` through ``out`` on connecting and on each new version it
    runs, polling ``receive()``, until version ``last`` (or 120 s)."""
    policy = marked_policy(-1.0)
    scheme.init_on_receiver(model_id="policy", model=policy, worker_idx=0)
    scheme.connect(worker_idx=0)
    seen = scheme.version
    out.send(("connected", seen, policy.module.marker.item()))
    deadline = time.monotonic() + 120
    try:
        while seen < last and time.monotonic() < deadline:
            got = scheme.receive(timeout=0.5)  # the version run now if newer, else None
            if got is not None and got != scheme.version:
                out.send(("wrong", got, scheme.version))
            if scheme.version != seen:  # also one applied before receive() was called
                seen = scheme.version
                out.send(("running", seen, policy.module.marker.item()))
    finally:
        scheme.shutdown()
        out.close()


def failing_env():  # type: ignore[no-untyped-def]
    """An environment that cannot be built: its worker process ends before it connects."""
    raise RuntimeError("this environment cannot be built")
