"""Prometheus metrics of a scheme: what its sends took, and where each worker stands.

On the trainer::

    scheme.init_on_sender(model=model, num_workers=4)
    aiowsync.metrics.export(scheme)       # into prometheus_client's default registry
    aiowsync.metrics.serve(9400)          # http://127.0.0.1:9400/metrics

and the same ``export(scheme)`` on each worker, after ``init_on_receiver()``. Needs the
``metrics`` extra (prometheus_client). Every metric, its labels and its meaning: the Metrics
page of the docs.

May import: aiowsync._exceptions, aiowsync._scheme, aiowsync._sending.
"""

from __future__ import annotations

try:
    import prometheus_client  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise ImportError(
        "aiowsync.metrics needs prometheus_client: pip install 'aiowsync[metrics]'"
    ) from exc

from ._export import Exporter, export
from ._serve import MetricsServer, serve
from ._tally import DEFAULT_BUCKETS

__all__ = ["DEFAULT_BUCKETS", "Exporter", "MetricsServer", "export", "serve"]
