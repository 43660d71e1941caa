"""Command line: ``aiowsync demo``, ``bench``, ``doctor`` and ``clean`` (also
``python -m aiowsync ...``)."""

from __future__ import annotations

import sys

USAGE = """\
usage: aiowsync demo [--workers N] [--sends N] [options]   a trainer and workers on this host
       aiowsync bench [--quick] [options]                  aiowsync against the raw limits
       aiowsync doctor [--model-bytes SIZE] [--workers N]  check this host before a run
       aiowsync clean                                      remove slots of crashed trainers
       aiowsync --version
       aiowsync COMMAND --help                             every option of a command"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from . import __version__

        print(f"aiowsync {__version__}")
        return 0
    if args[0] == "demo":
        from ._tools.demo import main as demo

        return demo(args[1:])
    if args[0] == "bench":
        from ._tools.bench import main as bench

        # The console script passes nothing: bench may then restart itself with its settings.
        return bench(None if argv is None else args[1:])
    if args[0] == "doctor":
        from ._tools.doctor import doctor_main

        return doctor_main(args[1:])
    if args[0] == "clean":
        from ._tools.doctor import clean_main

        return clean_main(args[1:])
    print(
        f"aiowsync: unknown command {args[0]!r} (commands: demo, bench, doctor, clean; "
        "aiowsync --help lists them)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
