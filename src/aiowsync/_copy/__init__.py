"""The copy engine: plain CPU tensors copied with memmoves or non-temporal stores, spread over a
few helper threads (``engine``, ``job``), kept off the waker's CPU (``steer``) and out of
torch's OpenMP pool (``omp``); ``_stream`` is the optional C module. It knows tensors and
byte ranges, not models or layouts.

May import: aiowsync._exceptions, aiowsync._util.
"""
