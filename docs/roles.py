"""A Griffe extension for the API reference: Sphinx roles in docstrings become code spans.

The docstrings cross-reference with Sphinx roles (``:class:`Layout```, ``:meth:`~x.Y.z```),
which Markdown shows as they are written. Before mkdocstrings parses a docstring, each role is
rewritten as the code span Sphinx would show: the explicit title if one is given, the last
dotted part after ``~``, else the whole target. Code spans rather than links: many targets are
private modules that the reference does not render, and a link to nothing fails the strict
build.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`(?P<body>[^`]+)`",
)
_TITLED = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")


def _shown(body: str) -> str:
    body = body.strip().lstrip("!")
    titled = _TITLED.match(body)
    if titled:
        return titled["title"]
    if body.startswith("~"):
        return body[1:].rsplit(".", 1)[-1]
    return body


def rewrite(text: str) -> str:
    """``text`` with every Sphinx role replaced by a Markdown code span."""
    return _ROLE.sub(lambda m: f"`{_shown(m['body'])}`", text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
