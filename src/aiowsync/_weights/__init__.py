"""Weights and layouts: flattening the containers users hand us (``flatten``), the table that
packs a model's tensors into flat buffers (``layout``), binding a model to views of them
(``binding``), the two weight formats (``strategy``) and several models as one (``models``).

May import: aiowsync._exceptions, aiowsync._protocol, aiowsync._util, aiowsync._copy.
"""
