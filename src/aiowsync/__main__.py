"""Command line: ``aiowsync demo`` (also ``python -m aiowsync demo``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: aiowsync demo [--workers N] [--sends N] [--width W] [--depth D]")
        print("       aiowsync demo --help")
        return 0 if args else 2
    if args[0] == "demo":
        from ._demo import main as demo

        return demo(args[1:])
    print(f"aiowsync: unknown command {args[0]!r} (try: aiowsync demo)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
