"""The weight-transfer engine ``"aiowsync"`` that vLLM loads in each of its worker processes.

vLLM calls it from its routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``); :class:`aiowsync.vllm.VLLMServers` makes those
calls for the trainer. The bytes never travel over HTTP: each worker is a receiver of the
trainer's scheme, and ``/update_weights`` names only the version to apply.

A version is applied whole inside ``/update_weights``, through vLLM's layerwise reload (the
model's ``load_weights``, which fuses, re-packs and shards the trainer's Hugging Face tensors as
vLLM's own loaders do), so that no step of the engine ever runs between two halves of a reload.
``/start_weight_update`` has nothing to do; ``/finish_weight_update`` lets the version applied
before go.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ._worker import WorkerReceiver

__all__ = [
    "SWITCH_LOG_ENV",
    "AiowsyncInitInfo",
    "AiowsyncUpdateInfo",
    "AiowsyncWeightTransferEngine",
]

log = logging.getLogger("aiowsync.vllm")

SWITCH_LOG_ENV = "AIOWSYNC_VLLM_SWITCH_LOG"
"""For measurements: a file to which each worker appends one JSON line per version it
serves, with the wall-clock times (``time.time()``) at which its reload ended, at which it
was labelled (``/finish_weight_update``) and of the model's first forward after that."""


@dataclass
class AiowsyncInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """``/init_weight_transfer_engine``'s body: the trainer's scheme, described."""

    scheme: dict[str, Any] = field(default_factory=dict, repr=False)
    """:func:`aiowsync.vllm._describe.describe`'s output (it holds a client secret key, so
    it stays out of the repr, and so out of vLLM's logs)."""
    first_worker: int = 0
    """The receiver index of this server's worker of rank 0."""
    server_url: str | None = None
    """The server's own URL, as the trainer reaches it: a worker resumes the server there if
    its trainer dies while the server is paused."""


@dataclass
class AiowsyncUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """``/update_weights``'s body: the version to apply."""

    version: int = -1
    take_back: bool = False
    """Undo the version applied and not yet labelled, if any, instead (``version`` is then
    the one the trainer last saw labelled, -1 for none)."""


class AiowsyncWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """Receives versions from an aiowsync trainer while the server generates; applies one
    through vLLM's reload when told to."""

    init_info_cls = AiowsyncInitInfo
    update_info_cls = AiowsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receiver: WorkerReceiver | None = None
        self._switch_log = os.environ.get(SWITCH_LOG_ENV)
        self._switch: dict[str, Any] | None = None
        """The times of the version last labelled, until its first forward is seen."""
        self._loaded_at = 0.0
        if self._switch_log:
            self.model.register_forward_pre_hook(self._first_forward)

    def _rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group

        parallel = self.parallel_config
        local = int(get_world_group().rank_in_group)
        return int(parallel.data_parallel_index) * int(parallel.world_size) + local

    def init_transfer_engine(self, init_info: AiowsyncInitInfo) -> None:
        previous = None
        if self._receiver is not None:  # a new trainer
            previous = self._receiver.detach()
            self._receiver = None
        rank = self._rank()
        self._receiver = WorkerReceiver(
            init_info.scheme,
            init_info.first_worker + rank,
            reload=self._reload,
            snapshot=self._snapshot,
            restore=self._restore,
            server_url=init_info.server_url if rank == 0 else None,
            previous=previous,
        )
        log.info(
            "worker %d joined the trainer at %s",
            init_info.first_worker + rank,
            init_info.scheme.get("address"),
        )

    def start_weight_update(self) -> None:
        self._need_receiver()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: AiowsyncUpdateInfo) -> None:
        self._need_receiver().apply(update_info.version, take_back=update_info.take_back)
        self._loaded_at = time.time()

    def finish_weight_update(self) -> None:
        if self._receiver is not None:
            version = self._receiver.finish()
            if self._switch_log and version is not None:
                self._switch = {
                    "worker": self._receiver.worker_idx,
                    "version": version,
                    "loaded": self._loaded_at,
                    "labelled": time.time(),
                }

    def _first_forward(self, module: Any, args: Any) -> None:
        switch, self._switch = self._switch, None
        if switch is None or not self._switch_log:
            return
        switch["first_forward"] = time.time()
        with open(self._switch_log, "a") as f:
            f.write(json.dumps(switch) + "\n")

    def shutdown(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    def _need_receiver(self) -> WorkerReceiver:
        if self._receiver is None:
            raise RuntimeError(
                "no trainer attached: /init_weight_transfer_engine first "
                "(aiowsync.vllm.VLLMServers.attach does it)"
            )
        return self._receiver

    # -- vLLM's reload --------------------------------------------------------------------------

    @torch.no_grad()
    def _reload(self, pairs: Any) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(pairs)
        finally:
            # Also on an error: every layer leaves its reload state (those not loaded get
            # their tensors back), so the model can run, or be loaded again.
            finalize_layerwise_reload(self.model, self.model_config)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: t.detach().clone() for k, t in self.model.state_dict().items()}

    @torch.no_grad()
    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        current = self.model.state_dict()
        for key, value in saved.items():
            current[key].copy_(value)
