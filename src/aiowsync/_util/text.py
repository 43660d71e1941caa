"""Text from peers and errors, made fit for logs and for the wire."""

from __future__ import annotations

__all__ = ["error_text", "excerpt", "first_line", "worth_logging"]


def excerpt(text: str, limit: int = 500) -> str:
    """``text`` cut to ``limit`` characters, as one line (text from a peer goes into logs)."""
    text = text.replace("\n", " ").replace("\r", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def first_line(exc: BaseException, limit: int = 500) -> str:
    """The first line of ``exc``'s message (its type name when it has none), cut to ``limit``."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:limit]


def error_text(exc: BaseException, limit: int = 60000) -> str:
    """``Type: message`` of ``exc``, as a nack carries it to the sender: at most ``limit``
    bytes in UTF-8 (what the sender's cap on a message counts), cut at a character."""
    text = f"{type(exc).__name__}: {exc}"
    # A lone surrogate (an undecodable file name in an OSError) becomes "?": it cannot travel.
    return text.encode("utf-8", errors="replace")[:limit].decode("utf-8", errors="ignore")


def worth_logging(count: int) -> bool:
    """True for the 1st, 10th, 100th... occurrence: a peer that keeps sending junk or retrying
    must not flood the log."""
    return str(count).rstrip("0") == "1"
