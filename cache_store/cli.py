"""Command line: ``python -m chorus cache {stats,list,verify,prune,rebuild-index} --workspace NAME``.

``--workspace`` is a workspace name, validated and resolved under ``--root`` (default: see
:func:`chorus.cache_store.default_cache_root`); ``--path DIR`` opens a workspace directory
directly instead. ``--url postgresql://...`` (default: ``CHORUS_CACHE_URL``, unless ``--path``)
works on the fleet store's workspace instead (this host's local tier under ``--root``). Output
is human-readable, or JSON with ``--json``. Exit status: 0 on success, 1 when ``verify`` finds
(and quarantines) damage or the index is inconsistent, 2 on bad arguments (or an unreachable
fleet store). Long work (verify, rebuild-index) shows a tqdm progress bar on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .paths import resolve_workspace


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chorus cache", description="Inspect and maintain a Chorus mask cache workspace.")
    sub = parser.add_subparsers(dest="action", required=True)
    for name, help_text in [("stats", "counts, bytes, index kinds, quarantine"),
                            ("list", "one line per entry"),
                            ("verify", "check every entry's checksum; quarantine damage; exit 1 if any"),
                            ("prune", "evict entries (LRU/LFU) down to the limits"),
                            ("rebuild-index", "rebuild the faiss index from the entries")]:
        p = sub.add_parser(name, help=help_text)
        where = p.add_mutually_exclusive_group()
        where.add_argument("--workspace", default="default", help="workspace name (validated; resolved under --root)")
        where.add_argument("--path", default=None, help="workspace directory (instead of a name)")
        p.add_argument("--root", default=None, help="cache root directory (default: CHORUS_CACHE_DIR, ComfyUI user dir, ~/.cache/chorus)")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--url", default=None, help="fleet store: postgresql://... (default: CHORUS_CACHE_URL; "
                                                   "put the password in a pgpass file or PGPASSWORD, not here)")
        if name == "prune":
            p.add_argument("--max-entries", type=int, default=None, help="keep at most this many entries")
            p.add_argument("--max-bytes", type=int, default=None, help="keep at most this many bytes")
        if name == "list":
            p.add_argument("--limit", type=int, default=0, help="show at most this many entries (0: all)")
    return parser


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def main(argv=None) -> int:
    """Run the cache command line with ``argv`` (without the leading ``cache``); return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        from .protocol import cache_url

        if args.path and args.url:
            raise ValueError("--path names a one-host workspace directory; with --url use --workspace")
        url = None if args.path else cache_url(args.url)
        if url is not None:  # the fleet store (PostgreSQL); this host's local tier under --root
            from .fleet import FleetStore

            ws = FleetStore.open(url, args.workspace, local_path=resolve_workspace(args.workspace, args.root),
                                 listen=False)
        else:
            path = Path(args.path).expanduser() if args.path else resolve_workspace(args.workspace, args.root)
            if not path.exists():
                raise ValueError(f"workspace {path} does not exist")
            from .workspace import Workspace  # torch/faiss are imported only once the arguments are good

            ws = Workspace.open(path)
    except (ValueError, ConnectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with ws:
        code = 0
        if args.action == "stats":
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
            lines = [f"{'id':>8}  {'signature':12}  {'size':>10}  {'hits':>5}  last used            prompt"]
            for e in result:
                prompt = str(e["meta"].get("prompt", ""))[:40].replace("\n", " ")
                lines.append(f"{e['id']:>8}  {e['sig_key'][:12]:12}  {_fmt_bytes(e['nbytes']):>10}  {e['hits']:>5}  "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['last_used']))}  {prompt}")
            text = "\n".join(lines)
        elif args.action == "verify":
            result = ws.verify(progress=True)
            code = 0 if result["ok"] and result["index_consistent"] else 1
            text = (f"checked {result['checked']} entries: " +
                    ("no damage" if result["ok"] else f"{len(result['damaged'])} damaged (quarantined)") +
                    f"; index consistent: {result['index_consistent']}; removed {result['orphans_removed']} orphan "
                    f"and {result['temp_files_removed']} temporary files")
            for d in result["damaged"]:
                text += f"\n  entry {d['id']} ({d['file']}): {d['reason']}"
        elif args.action == "prune":
            removed = ws.prune(max_bytes=args.max_bytes, max_entries=args.max_entries)
            result = {"removed": removed, "entries": len(ws)}
            text = f"removed {len(removed)} entries; {len(ws)} left"
        else:  # rebuild-index
            kinds = ws.rebuild_index(progress=True)
            result = {"index": kinds, "entries": len(ws)}
            text = f"rebuilt the index of {len(ws)} entries: " + (
                ", ".join(f"{k[:12]}: {v['kind']} x{v['entries']}" for k, v in kinds.items()) or "empty")
        print(json.dumps(result, indent=2, default=str) if args.json else text)
        return code
