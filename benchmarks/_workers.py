"""What ``bench_shm.py`` and ``bench_dist.py`` share with ``aiowsync bench``: the models, the
event-loop probe, the memory probe, the raw gloo limit and the worker process all live in
``aiowsync._tools.bench`` (the console command needs them in the package); this module gives the
scripts their old short names."""

from __future__ import annotations

import os

# Must happen before torch is imported: idle OpenMP threads must not spin on the 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from aiowsync._tools.bench._models import (
    Spec,
    build_model,
    few_large_spec,
    fingerprint,
    many_tensors_spec,
    poison_init,
    random_init,
    spec_bytes,
    stamp,
)
from aiowsync._tools.bench._probe import Ticker, malloc_trim, private_memory
from aiowsync._tools.bench._rawgloo import RawRoot
from aiowsync._tools.bench._worker import worker_main

__all__ = [
    "RawRoot",
    "Spec",
    "Ticker",
    "build_model",
    "few_large_spec",
    "fingerprint",
    "malloc_trim",
    "many_tensors_spec",
    "poison_init",
    "private_memory",
    "random_init",
    "spec_bytes",
    "stamp",
    "worker_main",
]
