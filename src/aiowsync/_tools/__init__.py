"""The command line's tools: ``aiowsync demo`` (``demo``), ``aiowsync doctor`` and
``aiowsync clean`` (``doctor``); ``aiowsync bench`` is ``bench/``. Tools use the library as a
user does, plus the host checks and the copy engine's facts.

May import: aiowsync, aiowsync._exceptions, aiowsync._config, aiowsync._util,
aiowsync._channel, aiowsync._copy, aiowsync._planes.shm, aiowsync._scheme.
"""
