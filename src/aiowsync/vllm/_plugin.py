"""The ``vllm.general_plugins`` entry point: registers the engine ``"aiowsync"``.

vLLM calls :func:`register` in each of its processes (the API server, the engine core, every
worker), possibly more than once; the engine's module is imported only where vLLM builds one.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "aiowsync"
"""The name given to ``--weight-transfer-config '{"backend": "aiowsync"}'``."""


def register() -> None:
    """Register the engine with vLLM's weight-transfer factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "aiowsync.vllm._engine", "AiowsyncWeightTransferEngine"
        )
    except ValueError:  # registered already in this process
        pass
