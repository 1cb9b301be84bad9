"""Command line: ``python -m chorus {demo,cache} ...``."""

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m chorus {demo,cache} [options]   (add -h to a command for its options)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "cache":
        from .cache_store.cli import main as cache_main

        return cache_main(rest)
    if command == "demo":
        from .demo.run import main as demo_main

        return demo_main(rest)
    print(f"unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
