"""The copy engine: plain CPU tensors copied with memmoves or non-temporal stores, spread over a
few helper threads (``engine``, ``job``), kept off the waker's CPU (``steer``) and out of
torch's OpenMP pool (``omp``); many small tensors gathered into flat buffers (``gather``),
and what each source copied last, to start the next copy early (``recent``); ``_stream`` is
the optional C module. It knows tensors and byte ranges, not models or layouts.

May import: aiowsync._exceptions, aiowsync._util.
"""
