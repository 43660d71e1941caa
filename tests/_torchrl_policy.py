"""A CartPole policy that writes its own ``marker`` weight into every frame it acts in, for
the TorchRL adapter tests (importable by the collectors' spawned workers)."""

from __future__ import annotations

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


def make_env():  # type: ignore[no-untyped-def]
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")
