"""The receiver's engine: connecting and its status (``engine``), the intake of updates
(``updates``), the tear-free switch (``apply``), the read guard (``guard``) and leases
(``lease``). It drives any data plane through the interface of ``aiowsync._planes``.

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._protocol,
aiowsync._copy, aiowsync._weights, aiowsync._channel, aiowsync._planes.
"""
