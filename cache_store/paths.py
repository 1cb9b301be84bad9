"""Where workspaces live: the cache root and validated workspace names.

Root resolution (first that applies): the ``root`` a caller passes; env ``CHORUS_CACHE_DIR``;
ComfyUI's user directory + ``/chorus`` when ComfyUI's ``folder_paths`` module is already loaded
(it always is inside ComfyUI; it is never imported from here, so this module needs no ComfyUI);
``~/.cache/chorus``. A root inside the pack folder is refused (``ValueError``): the pack folder is
replaced on update, and entries must survive that.

Workspace names from users are validated: one path component of letters, digits, ``.``, ``_``
and ``-`` (1-64 chars, not starting with ``.`` or ``-``), and the resolved directory must lie inside
the resolved root (symlinks included). Anything else raises ``ValueError`` naming the problem.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

LOG = logging.getLogger(__name__)

PACK_DIR = Path(__file__).resolve().parent.parent
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")


def _inside(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
        return True
    except ValueError:
        return False


def check_not_in_pack(path) -> Path:
    """Resolve ``path``; raise ``ValueError`` if it lies inside the pack folder."""
    resolved = Path(path).expanduser().resolve()
    if _inside(resolved, PACK_DIR):
        raise ValueError(f"cache directory {resolved} lies inside the pack folder {PACK_DIR}; choose another root")
    return resolved


def default_cache_root(root=None) -> Path:
    """The cache root directory (not created here), resolved as the module docstring says."""
    if root is not None and str(root) != "":
        chosen = Path(root)
    elif os.environ.get("CHORUS_CACHE_DIR"):
        chosen = Path(os.environ["CHORUS_CACHE_DIR"])
    else:
        folder_paths = sys.modules.get("folder_paths")
        user_dir = None
        if folder_paths is not None and hasattr(folder_paths, "get_user_directory"):
            try:
                user_dir = folder_paths.get_user_directory()
            except Exception as exc:  # a host without a user directory: fall through to the home cache
                LOG.warning("ComfyUI user directory unavailable (%s); using ~/.cache/chorus", exc)
        chosen = Path(user_dir) / "chorus" if user_dir else Path.home() / ".cache" / "chorus"
    return check_not_in_pack(chosen)


def validate_workspace_name(name) -> str:
    """Return ``name`` if it is a safe single-component workspace name, else raise ``ValueError``."""
    if not isinstance(name, str):
        raise ValueError(f"workspace name must be a string, got {type(name).__name__}")
    if name in (".", "..") or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid workspace name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter, digit or '_' (no path separators)"
        )
    return name


def resolve_workspace(name_or_path, root=None) -> Path:
    """Directory of workspace ``name_or_path`` under the cache root (see :func:`default_cache_root`).

    ``name_or_path`` is a user-facing name and is validated (no separators, no ``..``, no absolute
    paths); the result is guaranteed to lie inside the resolved root, else ``ValueError``. An empty
    name means ``"default"``. Nothing is created.
    """
    name = "default" if name_or_path in (None, "") else name_or_path
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    validate_workspace_name(name)
    base = default_cache_root(root)
    target = (base / name).resolve()
    if not _inside(target, base) or target == base:
        raise ValueError(f"workspace {name!r} resolves to {target}, outside the cache root {base}")
    check_not_in_pack(target)
    return target
