"""Where workspaces live: the cache root and validated workspace names.

Root resolution (first that applies): the ``root`` a caller passes (a relative one is resolved
against the caller's working directory: it is the caller's explicit choice); env
``CHORUS_CACHE_DIR``, which must be absolute (``~`` expanded): a relative value is refused
(``ValueError``), because workers started in different folders would silently use different
caches; ComfyUI's user directory + ``/chorus`` when ComfyUI's ``folder_paths`` module is already
loaded (it always is inside ComfyUI; it is never imported from here, so this module needs no
ComfyUI); ``~/.cache/chorus``. :func:`cache_root_source` says which rule chose the root. A root
inside the pack folder is refused (``ValueError``): the pack folder is replaced on update, and
entries must survive that.

Workspace names from users are validated: the whole name (a full match: a trailing newline is
refused) is one path component of letters, digits, ``.``, ``_`` and ``-`` (1-64 chars, not
starting with ``.`` or ``-``), and the resolved directory must lie inside the resolved root
(symlinks included). Anything else raises ``ValueError`` naming the problem.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

LOG = logging.getLogger(__name__)

PACK_DIR = Path(__file__).resolve().parent.parent
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")  # used with fullmatch


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


ENV_ROOT = "CHORUS_CACHE_DIR"


def cache_root_source(root=None) -> tuple[Path, str]:
    """``(root, rule)``: the cache root (resolved, not created) and which rule of the module
    docstring chose it, in words (for messages and ``--help``). Raises ``ValueError`` for a relative
    ``CHORUS_CACHE_DIR`` or a root inside the pack folder."""
    if root is not None and str(root) != "":
        chosen, rule = Path(root).expanduser(), "given root"
    elif os.environ.get(ENV_ROOT):
        chosen, rule = Path(os.environ[ENV_ROOT]).expanduser(), f"{ENV_ROOT}"
        if not chosen.is_absolute():
            raise ValueError(f"{ENV_ROOT}={os.environ[ENV_ROOT]!r} is a relative path: set it to an absolute "
                             "directory (each process would resolve it against its own working directory)")
    else:
        folder_paths = sys.modules.get("folder_paths")
        user_dir = None
        if folder_paths is not None and hasattr(folder_paths, "get_user_directory"):
            try:
                user_dir = folder_paths.get_user_directory()
            except Exception as exc:  # a host without a user directory: fall through to the home cache
                LOG.warning("ComfyUI user directory unavailable (%s); using ~/.cache/chorus", exc)
        if user_dir:
            chosen, rule = Path(user_dir) / "chorus", "ComfyUI user directory"
        else:
            chosen, rule = Path.home() / ".cache" / "chorus", f"default outside ComfyUI, {ENV_ROOT} unset"
    return check_not_in_pack(chosen), rule


def default_cache_root(root=None) -> Path:
    """The cache root directory (not created here), resolved as the module docstring says."""
    return cache_root_source(root)[0]


def validate_workspace_name(name) -> str:
    """Return ``name`` if it is a safe single-component workspace name, else raise ``ValueError``."""
    if not isinstance(name, str):
        raise ValueError(f"workspace name must be a string, got {type(name).__name__}")
    if name in (".", "..") or not _NAME_RE.fullmatch(name):
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
