"""The public facade: :class:`WeightSyncScheme` (``config``, ``running``, ``scheme``), the
sessions of its two roles (``sender``, ``receiver``), the two schemes with their planes
chosen (``shared_mem``, ``distributed``), the blocking face (``blocking``) and relays
(``relay``). The only package that joins the engines to the planes.

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._protocol,
aiowsync._copy, aiowsync._weights, aiowsync._channel, aiowsync._planes,
aiowsync._planes.shm, aiowsync._planes.dist, aiowsync._sending, aiowsync._receiving.
"""
