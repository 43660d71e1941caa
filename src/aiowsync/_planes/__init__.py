"""The data planes: how a version's bytes get from the sender to the receivers. ``base`` is
the interface every plane implements (:class:`DataPlane` and its two halves), ``memory`` the
in-process twin; what the real planes share is here too (``slot_table``, ``stager``,
``double``, ``digest``). The shared-memory plane is ``shm/``, torch.distributed ``dist/``.

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._protocol,
aiowsync._copy, aiowsync._weights.
"""
