"""Shared builders and child-process workers for the cache_store tests (test_cache_*.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

SIGNATURE = {"family": "wan", "variant": "test", "latent_shape": [16, 5, 12, 20], "block_size": 128,
             "token_order": "thw", "step_sigmas": [1.0, 0.75, 0.5, 0.25]}
DIM = 48


def tree_snapshot(root) -> dict:
    """name -> (mode, size, mtime_ns) of everything under ``root`` (links not followed, sizes of
    folders 0): equal snapshots mean nothing there was created, removed, written or chmod-ed."""
    root = Path(root)
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size if not p.is_dir() else 0, st.st_mtime_ns)
    return out


def small_masks(seed: int, layers: int = 2, heads: int = 3, qb: int = 9, kb: int = 13) -> dict:
    """Seeded bool maps ``{("high", step, layer, 0): [1, heads, qb, kb]}`` (kb not a multiple of 8)."""
    gen = torch.Generator().manual_seed(seed)
    return {("high", step, layer, 0): torch.rand(1, heads, qb, kb, generator=gen) < 0.3
            for step in range(2) for layer in range(layers)}


def embedding(seed: int, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=dim).astype(np.float32)


def clustered(n: int, dim: int, *, clusters: int, spread: float, seed: int) -> np.ndarray:
    """Unit vectors around ``clusters`` random centres (requests from templates), float32 ``[n, dim]``."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, dim)) / np.sqrt(dim)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


# what a forkserver child of the cache tests uses, imported once by the forkserver: the package alone
# resolves Workspace lazily, so each child would otherwise import torch, faiss and the store (~2-5 s).
# torch is named itself: the store no longer imports it, and the forkserver may not find cache_helpers
# (Python 3.11's forkserver keeps the interpreter's sys.path, not pytest's; a preload it cannot import is skipped).
FORKSERVER_PRELOAD = ["torch", "chorus.cache_store", "chorus.cache_store.workspace", "chorus.cache_store.seams", "cache_helpers"]


def forkserver_context():
    """A ``forkserver`` multiprocessing context whose server has imported :data:`FORKSERVER_PRELOAD`."""
    import multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def writer(path: str, seeds, conn=None, crash_phase: str | None = None, mask_kwargs=None) -> None:
    """Child process: add one entry per seed (meta["seed"] lets the parent rebuild the masks), sending
    each committed id through ``conn``. With ``crash_phase``, SIGKILL itself at that write phase of
    the first entry."""
    from chorus.cache_store import Workspace, seams

    if crash_phase is not None:
        def hook(phase):
            if phase == crash_phase:
                os.kill(os.getpid(), signal.SIGKILL)
        seams.workspace_phase = hook
    ws = Workspace.open(path)
    if conn is not None:
        conn.send(("ready", None))
    for seed in seeds:
        entry_id = ws.add(embedding(seed), small_masks(seed, **(mask_kwargs or {})),
                          {"signature": SIGNATURE, "seed": int(seed), "writer": os.getpid()})
        if conn is not None:
            conn.send(("committed", (entry_id, int(seed))))
    ws.close()
    if conn is not None:
        conn.send(("done", None))


def opener(path: str, barrier, results) -> None:
    """Wait at ``barrier``, then open (and so create) the workspace at ``path``; report the outcome."""
    from chorus.cache_store import Workspace

    barrier.wait()
    try:
        Workspace.open(path).close()
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 - the test reports whatever went wrong
        results.put(repr(exc))


def churner(path: str, conn, batch: int = 12, keep: int = 2) -> None:
    """Child process: forever add ``batch`` entries, then prune to ``keep`` (evicting many at once,
    as a worker with a full cache or an operator's prune does). Sends "ready" once, then the
    number of entries evicted after each prune."""
    from chorus.cache_store import Workspace

    ws = Workspace.open(path, timeout=30)
    conn.send(("ready", None))
    seed = 0
    while True:
        for _ in range(batch):
            ws.add(embedding(seed), small_masks(seed), {"signature": SIGNATURE, "seed": seed})
            seed += 1
        conn.send(("evicted", len(ws.prune(max_entries=keep))))


HOLDER = r"""
import sqlite3, sys
from filelock import FileLock
path, with_lock = sys.argv[1], sys.argv[2] == "1"
lock = FileLock(path + "/write.lock")
if with_lock:
    lock.acquire()
db = sqlite3.connect(path + "/chorus.sqlite3", isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.read()
"""


class Holder:
    """A second process holding the workspace's SQLite write transaction (and the writers' lock)."""

    def __init__(self, path, with_lock=True):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "1" if with_lock else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self):
        self.proc.stdin.close()
        self.proc.wait(30)
