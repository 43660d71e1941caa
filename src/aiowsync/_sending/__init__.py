"""The sender's engine: its life cycle, sends and acks (``engine``), the tables it shares
with its pieces (``state``), staging and announcing a version (``staging``), the background
task that reads the control channel (``control``), handshakes (``handshake``, ``welcome``),
the table of its receivers (``peers``, ``workers``), announcements and retries (``announce``,
``retries``), where a send's weights come from (``source``, ``watch``) and what a send gives
back (``outcome``). It drives any data plane through the interface of ``aiowsync._planes``.

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._protocol,
aiowsync._copy, aiowsync._weights, aiowsync._channel, aiowsync._planes.
"""
