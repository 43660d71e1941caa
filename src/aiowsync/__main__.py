"""Command line: ``aiowsync demo`` and ``aiowsync bench`` (also ``python -m aiowsync ...``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: aiowsync demo [--workers N] [--sends N] [--width W] [--depth D] [options]")
        print("       aiowsync bench [--quick] [--models M,...] [--workers N,...] [options]")
        print("       aiowsync demo --help | aiowsync bench --help   (every option)")
        return 0 if args else 2
    if args[0] == "demo":
        from ._demo import main as demo

        return demo(args[1:])
    if args[0] == "bench":
        from ._bench import main as bench

        # The console script passes nothing: bench may then restart itself with its settings.
        return bench(None if argv is None else args[1:])
    print(
        f"aiowsync: unknown command {args[0]!r} (try: aiowsync demo, aiowsync bench)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
