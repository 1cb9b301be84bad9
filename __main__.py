"""Command line: ``python -m chorus {demo,cache,check} ...``."""

import sys

HELP = """

commands:
  demo    the README's demo: similar and unrelated I2V requests through the engine on a tiny random Wan (CPU)
  cache   inspect and maintain a mask cache workspace: stats, list, verify, prune, rebuild-index, init
          (stats, list and verify without --repair are read-only; `cache -h` says which cache root is used)
  check   which attention kernel runs on this machine; with --run, whether it computes right here and how
          fast it is beside PyTorch's dense attention (exit 1 when the numerics check fails)

The pack also installs the `chorus` command (pip's console script): `chorus cache stats` is
`python -m chorus cache stats`."""


def main(argv=None) -> int:
    """Run a command; whatever it writes to stderr (argparse's errors echo mistyped arguments, which
    may be a URL holding a password) is redacted (``cache_store/redaction.py``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .cache_store.redaction import redacting_stderr

    with redacting_stderr(argv):
        return _dispatch(argv)


def _dispatch(argv: list) -> int:
    usage = "usage: python -m chorus {demo,cache,check} [options]   (add -h to a command for its options)"
    if not argv:
        print(f"error: no command given ({usage})", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage + HELP)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "cache":
        from .cache_store.cli import main as cache_main

        return cache_main(rest)
    if command == "demo":
        from .demo.run import main as demo_main

        return demo_main(rest)
    if command == "check":
        from .kernels.selfcheck import main as check_main

        return check_main(rest)
    print(f"error: unknown command {command!r} ({usage})", file=sys.stderr)  # redacted on its way out
    return 2


if __name__ == "__main__":
    sys.exit(main())
