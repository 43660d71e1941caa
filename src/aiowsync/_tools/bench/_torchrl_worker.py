"""A worker process of a TorchRL tree (see ``_torchrl``): TorchRL's receiver, a reader that
counts mixed reads, and a ticker thread, driven over a pipe by the tree's sender.

Commands: ``("read", seconds)`` starts reading (each read attributed to the sender's phase,
shared through ``phase``), ``("stop",)`` answers ``("reads", reads, mixed)``; ``("peek",)``
answers what the model holds and whether that is a mix; ``("tick_start",)``,
``("tick_mark",)``, ``("tick_stop",)`` drive the ticker; ``("exit",)`` ends the process.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import Connection
from typing import Any

from ._models import Reader, build_model, fill, model_spec
from ._probe import ThreadTicker

__all__ = ["Context", "worker_main"]


class Context:
    """The least a TorchRL scheme needs from a collector: the model and one device per worker."""

    def __init__(self, policy: Any, n_workers: int) -> None:
        import torch

        self.policy = policy
        self.policy_device = [torch.device("cpu")] * n_workers


def worker_main(
    conn: Connection, idx: int, scheme: Any, scheme_name: str, model: str, n: int, phase: Any
) -> None:
    import torch

    torch.set_num_threads(1)
    module = build_model(model_spec(model), lambda t: fill([t], -1))
    holder = Context(module, n)
    if scheme_name == "distributed":  # ranks are 1-based there; the sender is rank 0
        scheme.init_on_receiver(model_id="policy", context=holder, worker_idx=idx + 1)
    else:
        scheme.init_on_receiver(model_id="policy", model=module, worker_idx=idx)
    scheme.connect()
    reader = Reader(lambda: list(module.state_dict().values()), refresh=False)
    ticker = ThreadTicker()
    conn.send(("ready", sorted(reader.values()[0])))
    reads, mixed, reading, until = [0, 0, 0], [0, 0, 0], False, 0.0
    try:
        while True:
            if reading:
                p0 = phase.value
                bad = reader.mixed()
                p = max(p0, phase.value)
                reads[p] += 1
                mixed[p] += bad
                time.sleep(0)  # let TorchRL's receiver thread take the GIL between reads
                reading = time.monotonic() < until
                if not conn.poll():
                    continue
            elif not conn.poll(1.0):
                continue
            msg = conn.recv()
            if msg[0] == "read":
                reads, mixed, reading = [0, 0, 0], [0, 0, 0], True
                until = time.monotonic() + msg[1]
                conn.send(("ok",))
            elif msg[0] == "stop":
                reading = False
                conn.send(("reads", reads, mixed))
            elif msg[0] == "peek":
                conn.send(("peek", sorted(reader.values()[0]), reader.mixed()))
            elif msg[0] == "tick_start":
                ticker.start()
                conn.send(("ok",))
            elif msg[0] == "tick_mark":
                conn.send(("gap", ticker.mark()))
            elif msg[0] == "tick_stop":
                ticker.stop()
                conn.send(("ok",))
            elif msg[0] == "exit":
                break
    except (EOFError, OSError):
        pass
    finally:
        ticker.close()
        with contextlib.suppress(Exception):
            scheme.shutdown()
