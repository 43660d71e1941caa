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
