"""The shared-memory plane: slot files in /dev/shm (``slots``), the sender's half that stages
into them (``sender``), the receivers' half that maps them (``plane``), and the fixed window
a remapping receiver sees them through (``window``).

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._protocol,
aiowsync._copy, aiowsync._weights, aiowsync._planes.
"""
