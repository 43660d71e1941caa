"""The torch.distributed plane: its configuration (``config``), the store and process groups
of our own (``store``, ``store_client``, ``groups``, and ``collectives`` on them), a version
in buckets (``buckets``), the sender's transfers and their retries (``plane``, ``send``,
``delivery``), a chain member's part (``chain``) and the receivers' half (``receiver``).

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._protocol,
aiowsync._copy, aiowsync._weights, aiowsync._planes.
"""
