"""Command line: ``python -m chorus cache {stats,list,verify,prune,rebuild-index,init} --workspace NAME``.

``--workspace`` is a workspace *name* (never a folder), validated and resolved under the cache
root: ``--root DIR``, or ``--comfyui DIR`` meaning ``DIR/user/chorus`` (where ComfyUI keeps the
cache), else the rules of :func:`chorus.cache_store.default_cache_root` (from a shell, without
``CHORUS_CACHE_DIR``, that is ``~/.cache/chorus``, not ComfyUI's folder: ``--help`` and every error
say which root was used). ``--path DIR`` opens a workspace directory directly instead.
``--url postgresql://...`` (default: ``CHORUS_CACHE_URL``, unless ``--path``) works on the fleet
store's workspace instead (this host's local tier under the root).

What each command may change:

* ``stats``, ``list`` and ``verify`` (without ``--repair``) are read-only: they create, write, move
  and delete nothing, neither on this host nor in PostgreSQL (read-only handles; the fleet's
  sessions are read-only too), and a workspace (or fleet database) that does not exist is an
  error that creates nothing;
* ``verify --repair`` also quarantines damaged entries and removes orphan and temporary files;
  ``prune`` evicts; ``rebuild-index`` rewrites the index; none of them creates a workspace;
* ``init`` creates the workspace (with ``--url``: the fleet tables if missing, then the
  workspace's row) and is the only command that does.

Limits (``prune --max-entries / --max-bytes``, ``list --limit``) go through
:mod:`~chorus.cache_store.limits`: a negative, non-integral or absurd number is an error that
deletes nothing, and a limit of 0 (keep nothing: every entry is deleted) needs ``--delete-all``.

Output is human-readable, or JSON with ``--json``. Exit status: 0 on success, 1 when ``verify``
finds damage (quarantined with ``--repair``), the index is inconsistent or an entry could not be
checked for want of memory (left as it is; entries evicted by a worker while verify ran are listed,
not damage), 2 on any error: bad arguments, a folder that is
not a workspace, a permission, disk or SQLite error, a store busy past ``--timeout`` (default
30 s), an unreachable fleet store; an error is one line on stderr starting ``error:``, never a
traceback, and never holds a password: argparse's own messages (which echo mistyped arguments,
e.g. a URL given where a command was expected) and every error line pass through
:func:`~chorus.cache_store.redaction.redact`. Long work (verify, rebuild-index) shows a tqdm
progress bar on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .limits import parse_limit
from .paths import ENV_ROOT, cache_root_source, resolve_workspace
from .redaction import redacting_stderr

READ_ONLY_ACTIONS = ("stats", "list", "verify")  # verify without --repair
CLI_TIMEOUT = 30.0  # seconds maintenance waits for busy workers (a prompt's calls wait at most CHORUS_CACHE_TIMEOUT)


def _root_epilog() -> str:
    try:
        root, rule = cache_root_source()
        now = f"now: {root} ({rule})"
    except (ValueError, OSError) as exc:
        now = f"now: unresolved ({exc})"
    return ("cache root, first that applies: --root DIR; --comfyui DIR (= DIR/user/chorus, where ComfyUI keeps it); "
            f"{ENV_ROOT}; ~/.cache/chorus (a shell does not know ComfyUI's folder). {now}. "
            "Also installed as the `chorus` command: `chorus cache stats ...`.")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with errors as one line ``error: ...`` (exit 2) instead of usage + message (redacted
    with all of stderr by :func:`main`: argparse echoes the arguments it refuses, which may be a URL
    holding a password)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _limit(name: str):
    """An argparse ``type``: a limit as :func:`limits.parse_limit` reads it."""
    def convert(text):
        try:
            return parse_limit(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = name
    return convert


def _parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m chorus cache", description="Inspect and maintain a Chorus mask cache workspace.",
                                     epilog=_root_epilog())
    sub = parser.add_subparsers(dest="action", required=True)
    for name, help_text in [("stats", "counts, bytes, index kinds, quarantine (read-only)"),
                            ("list", "one line per entry: hits, the share of its hits' sparse calls with the pooled tail, dense fallbacks (read-only)"),
                            ("verify", "check every entry; exit 1 on damage (read-only; --repair quarantines it)"),
                            ("prune", "evict entries (LRU/LFU) down to the limits"),
                            ("rebuild-index", "rebuild the faiss index from the entries"),
                            ("init", "create the workspace (with --url: the fleet tables too, if missing)")]:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_root_epilog())
        where = p.add_mutually_exclusive_group()
        where.add_argument("--workspace", default="default",
                           help="workspace NAME under the cache root (validated; not a folder: use --path)")
        where.add_argument("--path", default=None, help="workspace directory DIR (instead of a name)")
        roots = p.add_mutually_exclusive_group()
        roots.add_argument("--root", default=None, help=f"cache root directory (default: {ENV_ROOT}, else ~/.cache/chorus)")
        roots.add_argument("--comfyui", default=None, metavar="DIR",
                           help="the ComfyUI folder: the cache root is DIR/user/chorus")
        p.add_argument("--timeout", type=float, default=CLI_TIMEOUT,
                       help=f"seconds to wait for busy workers before giving up (default {CLI_TIMEOUT:g})")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--url", default=None, help="fleet store: postgresql://... (default: CHORUS_CACHE_URL; "
                                                   "put the password in a pgpass file or PGPASSWORD, not here)")
        if name == "prune":
            p.add_argument("--max-entries", type=_limit("--max-entries"), default=None,
                           help="keep at most this many entries (default: the workspace's limits)")
            p.add_argument("--max-bytes", type=_limit("--max-bytes"), default=None,
                           help="keep at most this many bytes (default: the workspace's limits)")
            p.add_argument("--delete-all", action="store_true",
                           help="confirm a limit of 0: every entry of the workspace is deleted")
        if name == "verify":
            p.add_argument("--repair", action="store_true",
                           help="quarantine damaged entries and remove orphan and temporary files (else read-only)")
        if name == "list":
            p.add_argument("--limit", type=_limit("--limit"), default=0, help="show at most this many entries (0: all)")
    return parser


def _fmt_time(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (TypeError, ValueError, OverflowError, OSError):
        return f"{'?':19}"


def _fmt_bytes(n: int | None) -> str:
    if n is None:  # a row whose size is not an integer (edited by hand)
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def main(argv=None) -> int:
    """Run the cache command line with ``argv`` (without the leading ``cache``); return the exit code.
    Everything it writes to stderr is redacted (``redaction.redacting_stderr``: the passwords of URLs
    in ``argv`` too, wherever they reappear)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with redacting_stderr(argv):
        return _main(argv)


def _main(argv: list) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        for option in ("path", "root", "comfyui", "url"):  # an empty value is a mistake, not "the default"
            if getattr(args, option, None) == "":
                parser.error(f"--{option}: empty")
    except SystemExit as exc:
        return int(exc.code or 0)
    where = ""
    try:
        root = _cli_root(args)
        where = _describe(args, root)
        _check_limits_confirmed(args)
        with _open(args, root) as ws:
            code, result, text = _run(args, ws)
    except Exception as exc:  # noqa: BLE001 - every error is one line, exit 2 (exit 1 means damage found)
        message = " ".join((str(exc) or type(exc).__name__).split())
        if not isinstance(exc, (ValueError, OSError)):
            message = f"{type(exc).__name__}: {message}"
        print(f"error: {message}" + (f" [{where}]" if where else ""), file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str) if args.json else text)
    return code


def _read_only(args) -> bool:
    return args.action in READ_ONLY_ACTIONS and not getattr(args, "repair", False)


def _check_limits_confirmed(args) -> None:
    """A prune limit of 0 deletes every entry: only with ``--delete-all``."""
    if args.action != "prune" or args.delete_all:
        return
    for flag, value in (("--max-entries", args.max_entries), ("--max-bytes", args.max_bytes)):
        if value == 0:
            raise ValueError(f"{flag} 0 keeps no entry: every entry of the workspace would be deleted; add "
                             "--delete-all to confirm (nothing was deleted)")


def _open(args, root):
    """The store the command works on: read-only for read-only commands, never created except by
    ``init`` (module docstring)."""
    from .protocol import cache_url

    if args.path and args.url:
        raise ValueError("--path names a one-host workspace directory; with --url use --workspace")
    url = None if args.path else cache_url(args.url)
    create, readonly = args.action == "init", _read_only(args)
    if url is not None:  # the fleet store (PostgreSQL); this host's local tier under the root
        from .fleet import FleetStore

        return FleetStore.open(url, args.workspace, local_path=_resolve(args.workspace, root), listen=False,
                               create=create, readonly=readonly, timeout=args.timeout)
    path = Path(args.path).expanduser().absolute() if args.path else _resolve(args.workspace, root)
    if not create and not path.exists():
        raise ValueError(f"workspace {path} does not exist; nothing was created (python -m chorus cache init "
                         "creates one)")
    if create and path.is_dir() and not (path / "chorus.sqlite3").exists() and any(path.iterdir()):
        raise ValueError(f"{path} is a folder with other files and is not a Chorus cache workspace; init creates a "
                         "workspace only in a new or empty folder (nothing was created there)")
    from .workspace import Workspace  # faiss is imported only once the arguments are good (torch by no command)

    return Workspace.open(path, create=create, readonly=readonly, timeout=args.timeout)


def _cli_root(args):
    """The root the options name (None: the default rules). Raises ValueError for a bad --comfyui."""
    if args.comfyui is not None:
        comfy = Path(args.comfyui).expanduser()
        if not comfy.is_dir():
            raise ValueError(f"--comfyui {args.comfyui}: not a directory (give the ComfyUI folder; the cache "
                             "root is its user/chorus)")
        return comfy / "user" / "chorus"
    return args.root


def _describe(args, root) -> str:
    """Where the command works, for error messages: the workspace and which root was used."""
    if args.path:
        return f"workspace directory {args.path}"
    try:
        resolved, rule = cache_root_source(root)
    except (ValueError, OSError):
        return ""  # the error itself says why the root cannot be resolved
    rule = "--comfyui" if args.comfyui is not None else ("--root" if root is not None else rule)
    return f"workspace {args.workspace!r} under cache root {resolved} ({rule})"


def _resolve(name, root):
    try:
        return resolve_workspace(name, root)
    except ValueError as exc:
        if isinstance(name, str) and ("/" in name or "\\" in name):
            raise ValueError(f"{exc}; --workspace takes a name under the cache root, use --path DIR for a folder") from None
        raise


def _run(args, ws):
    """Run the action on an open store: ``(exit code, JSON result, text)``."""
    code = 0
    if args.action == "init":
        result = ws.stats()
        text = f"workspace {result['path']} is ready: {result['entries']} entries"
    elif args.action == "stats":
        result = ws.stats()
        text = (f"workspace {result['path']}\n  entries: {result['entries']} ({_fmt_bytes(result['bytes'])}), "
                f"hits: {result['hits']}, signatures: {result['signatures']}, dim: {result['dim']}\n"
                f"  limits: {result['limits']}\n  index: " +
                (", ".join(f"{k[:12]}: {v['kind']} x{v['entries']}" for k, v in result["index"].items()) or "empty") +
                f"\n  quarantined: {len(result['quarantined'])}")
    elif args.action == "list":
        result = ws.entries()
        if args.limit:
            result = result[: args.limit]
        lines = [f"{'id':>8}  {'signature':12}  {'size':>10}  {'hits':>5}  {'tail':>6}  {'dense':>5}  last used"
                 "            prompt"]
        for e in result:
            # shown, not interpreted: a stored prompt's control characters (terminal escapes) print as "?"
            prompt = "".join(c if c.isprintable() else "?" for c in str(e["meta"].get("prompt", ""))[:40])
            runs = e.get("runs") or {}
            tail = f"{runs['tail_calls'] / runs['sparse_calls']:.0%}" if runs.get("sparse_calls") else "-"
            lines.append(f"{e['id']:>8}  {str(e['sig_key'])[:12]:12}  {_fmt_bytes(e['nbytes']):>10}  {e['hits']:>5}  "
                         f"{tail:>6}  {runs.get('fallback_calls', 0):>5}  {_fmt_time(e['last_used'])}  {prompt}")
        text = "\n".join(lines)
    elif args.action == "verify":
        result = ws.verify(progress=True)
        code = 0 if result["ok"] and result["index_consistent"] and not result.get("unchecked") else 1
        repaired = "quarantined" if args.repair else "not quarantined: run verify --repair"
        text = (f"checked {result['checked']} entries: " +
                ("no damage" if result["ok"] else f"{len(result['damaged'])} damaged ({repaired})") +
                f"; index consistent: {result['index_consistent']}; removed {result['orphans_removed']} orphan "
                f"and {result['temp_files_removed']} temporary files")
        for d in result["damaged"]:
            text += f"\n  entry {d['id']} ({d['file']}): {d['reason']}"
        for u in result.get("unchecked", []):
            text += f"\n  entry {u['id']}: not checked ({u['reason']}; left as it is)"
        if result.get("evicted"):
            text += (f"\n  {len(result['evicted'])} entries were evicted or removed by a worker while verify ran "
                     "(not damage)")
        if result.get("cleanup_skipped") and args.repair:
            text += f"\n  orphan cleanup skipped: {result['cleanup_skipped']}"
        for stray in result.get("stray", []):
            text += f"\n  left alone (not made by the store): {stray}"
    elif args.action == "prune":
        removed = ws.prune(max_bytes=args.max_bytes, max_entries=args.max_entries)
        result = {"removed": removed, "entries": len(ws)}
        text = f"removed {len(removed)} entries; {len(ws)} left"
    else:  # rebuild-index
        kinds = ws.rebuild_index(progress=True)
        result = {"index": kinds, "entries": len(ws)}
        text = f"rebuilt the index of {len(ws)} entries: " + (
            ", ".join(f"{k[:12]}: {v['kind']} x{v['entries']}" for k, v in kinds.items()) or "empty")
    return code, result, text
