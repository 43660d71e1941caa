"""The one compiled part of aiowsync: ``aiowsync._stream`` (non-temporal copies).

It is optional: where it cannot be built (no C compiler), the install goes on without it and
aiowsync copies with torch and ``memmove`` instead. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("aiowsync._copy._stream", ["src/aiowsync/_copy/_stream.c"], optional=True),
    ]
)
