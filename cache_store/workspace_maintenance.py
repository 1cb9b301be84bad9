"""The workspace's maintenance: deletion, quarantine, eviction and prune, orphan cleanup, verify.

Deleting commits first and removes files after (a crash leaves orphans, never rows without a
file); quarantining moves the directory entry itself (a link is moved, never followed) into
``quarantine/`` before the commit, with the reason in SQLite. Only names the store makes are
touched; anything else in ``entries/`` is reported as ``stray``. Size cap: ``max_bytes`` and/or
``max_entries``; eviction by ``"lru"`` (oldest ``last_used`` first) or ``"lfu"`` (fewest ``hits``,
then oldest) after each add and in :meth:`prune`; limits that are not valid evict nothing
(``limits.py``). :meth:`verify` reads every entry (file kind, size, sha256, decodes), quarantines
only real damage (an entry whose row went away meanwhile was evicted: ``evicted``), cleans orphans
under the writers' lock and checks the index at one generation.

:class:`WorkspaceMaintenance` is a part of :class:`~chorus.cache_store.workspace.Workspace` (a
mixin): it uses the handle's connections, locks and directory descriptors (``_rdb``,
``_rmutex``, ``_writing``, ``_dir_fd``, ``_entry_fd``, ``_quarantine_fd``), its entry checks
(``_read_checked``, ``_decode_checked``) and its index (``_index_committed``, ``_index_matches``,
``_maybe_save_index``). Tested in ``tests/test_cache_safety.py`` (damage quarantined while
searches go on, verify, SIGKILL at each phase), ``tests/test_cache_workspace.py`` (eviction,
limits), ``tests/test_cache_hardening.py`` (verify beside an evicting worker, strays, links
moved not followed) and ``tests/test_cache_limits.py``.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time

from . import seams
from .entries import CorruptEntryError, EntryGone
from .entry_format import decode_entry_arrays
from .errors import StoreBusyError
from .limits import eviction_caps, eviction_order, over_caps, pick_victims, prune_targets
from .safe_fs import TEMP_NAME_RE, fsync_dir
from .workspace_db import ENTRY_DIR, ENTRY_NAME_RE, ROW_NBYTES, read_generation, set_setting, store_call, stored_limits

LOG = logging.getLogger(__name__)


class WorkspaceMaintenance:
    """The maintenance part of a workspace handle (see the module docstring)."""

    def _delete_locked(self, db, ids, *, quarantine_reason: str | None = None, expect_file: str | None = None) -> list[int]:
        """Delete rows (and files, or move them to quarantine). Caller holds the writers' lock.
        With ``expect_file``, only a row still naming that file is touched."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        rows = []
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            rows.extend(db.execute(
                f"SELECT id, file, sig_key, meta_json FROM entries WHERE id IN ({','.join('?' * len(part))})",
                part).fetchall())
        if expect_file is not None:
            rows = [r for r in rows if r[1] == expect_file]
        if not rows:
            return []
        if quarantine_reason is not None:
            for _, file, _, _ in rows:
                if not ENTRY_NAME_RE.fullmatch(file):
                    continue  # a row naming something the store never makes: leave the path alone
                try:  # moves the directory entry itself: a link is moved, never followed
                    os.replace(file, file, src_dir_fd=self._entry_fd, dst_dir_fd=self._quarantine_fd)
                except FileNotFoundError:
                    pass
            fsync_dir(self._quarantine_fd)
        db.execute("BEGIN IMMEDIATE")
        try:
            generation = read_generation(db)
            for entry_id, file, key, meta_json in rows:
                db.execute("DELETE FROM entries WHERE id=?", (entry_id,))
                if quarantine_reason is not None:
                    db.execute("INSERT INTO quarantine VALUES(?, ?, ?, ?, ?, ?)",
                               (entry_id, file, quarantine_reason, time.time(), key, meta_json))
            set_setting(db, "generation", generation + 1)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            if quarantine_reason is not None:
                self._unquarantine_files([r[1] for r in rows])
            raise
        if quarantine_reason is None:
            for _, file, _, _ in rows:  # after the commit: a crash here leaves orphans, never dangling rows
                if ENTRY_NAME_RE.fullmatch(file):
                    try:
                        os.unlink(file, dir_fd=self._entry_fd)
                    except (FileNotFoundError, IsADirectoryError, PermissionError):
                        pass  # a directory under an entry's name is reported by verify as stray
        removed = [r[0] for r in rows]
        self._index_committed(generation, removed=removed)
        return removed

    def _unquarantine_files(self, files) -> None:
        """Move files back from ``quarantine/`` after their quarantine's transaction failed, so that
        the rows still name files in ``entries/`` (the next reader finds the same damage and its reason)."""
        for file in files:
            if ENTRY_NAME_RE.fullmatch(file):
                try:
                    os.replace(file, file, src_dir_fd=self._quarantine_fd, dst_dir_fd=self._entry_fd)
                except OSError as exc:
                    LOG.warning("workspace %s: could not move %s back from quarantine/: %s", self.path, file, exc)

    def _quarantine(self, entry_id: int, file: str, reason: str) -> bool:
        """Move a damaged entry aside. Returns False when its row is gone already (evicted or
        removed meanwhile: not damage). On a read-only handle, or when the store stays busy past
        the time bound, the entry is only set aside in this handle (left out of its searches) and
        logged; the next writable handle that reads it quarantines it."""
        if self.readonly:
            self._reopen_if_written()  # an immutable read of a database written since would not see the row go
            with self._rmutex:
                if self._rdb.execute("SELECT 1 FROM entries WHERE id=? AND file=?", (entry_id, file)).fetchone() is None:
                    return False
            LOG.error("entry %d of %s is damaged (%s); read-only: not quarantined", entry_id, self.path, reason)
            self._set_aside_entry(entry_id)
            return True
        LOG.error("quarantining entry %d of %s: %s", entry_id, self.path, reason)
        try:
            with self._writing() as db:
                self._sync_index()
                done = bool(self._delete_locked(db, [entry_id], quarantine_reason=reason, expect_file=file))
        except (StoreBusyError, sqlite3.OperationalError) as exc:
            LOG.error("entry %d of %s is damaged (%s); quarantine deferred: %s", entry_id, self.path, reason, exc)
            self._set_aside_entry(entry_id)
            return True
        if done:
            return True
        with self._rmutex:
            return self._rdb.execute("SELECT 1 FROM entries WHERE id=? AND file=?", (entry_id, file)).fetchone() is not None

    def _set_aside_entry(self, entry_id: int) -> None:
        with self._rmutex:
            self._set_aside.add(int(entry_id))
            if self._index is not None and int(entry_id) in self._index.where:
                self._index.remove([int(entry_id)])

    def _evict_after_write(self, db, entry_id: int) -> None:
        """The eviction after a committed add (caller holds the writers' lock). The entry is written
        whatever happens here: when SQLite's write lock stays busy past the time bound (another
        process's hit flush takes it without the writers' lock) or a row fails its checks, the
        eviction waits for the next write or ``prune`` (logged) and the add still returns its id."""
        try:
            self._evict_locked(db, protect=entry_id)
        except (sqlite3.Error, OSError, ValueError, TypeError) as exc:
            LOG.warning("workspace %s: entry %d written; eviction deferred to the next write (%s: %s)",
                        self.path, entry_id, type(exc).__name__, exc)
        self._maybe_save_index()

    def _evict_locked(self, db, protect=None, max_bytes=None, max_entries=None, *, strict: bool = False) -> list[int]:
        """Evict down to the caps (:func:`limits.eviction_caps`: the prune targets given, else the
        stored limits). Limits that are not valid evict nothing: ``ValueError`` when ``strict``
        (``prune``), else logged (the eviction after a write)."""
        try:
            cap_bytes, cap_entries, policy = eviction_caps(stored_limits(db), max_bytes, max_entries)
        except ValueError as exc:
            if strict:
                raise
            LOG.error("workspace %s: %s", self.path, exc)
            return []
        count, total = db.execute(f"SELECT COUNT(*), COALESCE(SUM({ROW_NBYTES}), 0) FROM entries").fetchone()
        if not over_caps(count, total, cap_bytes, cap_entries):
            return []
        candidates = db.execute(f"SELECT id, COALESCE({ROW_NBYTES}, 0) FROM entries WHERE id != ? "
                                f"ORDER BY {eviction_order(policy)} "
                                "LIMIT ?", (protect if protect is not None else -1, count)).fetchall()
        victims = pick_victims(candidates, count, total, cap_bytes, cap_entries)
        if victims:
            LOG.info("evicting %d entries (%s) from %s", len(victims), policy, self.path)
        return self._delete_locked(db, victims)

    @store_call
    def prune(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> list[int]:
        """Evict (by the workspace policy) until at most ``max_bytes`` bytes and ``max_entries``
        entries are left (each ``None``: the stored limit; 0 keeps nothing); returns removed ids.
        Raises ``ValueError`` (having deleted nothing) for a negative, NaN, infinite, non-integral
        or absurd target (:mod:`~chorus.cache_store.limits`)."""
        prune_targets(max_bytes, max_entries)
        with self._writing() as db:
            self._sync_index()
            removed = self._evict_locked(db, max_bytes=max_bytes, max_entries=max_entries, strict=True)
            self._maybe_save_index()
            return removed

    def _clean_locked(self, known: set) -> dict:
        """Delete store-named temporary files and entry files without a row; report the rest."""
        temps, orphans, stray = 0, 0, []
        for dir_fd, prefix, entry_names in ((self._entry_fd, ENTRY_DIR + "/", True), (self._dir_fd, "", False)):
            if dir_fd is None:
                continue
            with os.scandir(dir_fd) as it:
                names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for name, is_dir in names:
                is_temp = TEMP_NAME_RE.fullmatch(name) is not None
                is_entry = entry_names and ENTRY_NAME_RE.fullmatch(name) is not None
                if not entry_names and not is_temp:
                    continue  # the workspace directory's own files
                if is_dir or not (is_temp or is_entry):
                    stray.append(prefix + name + ("/" if is_dir else ""))
                    continue
                if is_entry and name in known:
                    continue
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    continue
                if is_temp:
                    temps += 1
                else:
                    orphans += 1
        if stray:
            LOG.warning("workspace %s holds files the store did not make (left alone): %s", self.path,
                        ", ".join(stray[:20]))
        return {"temp_files_removed": temps, "orphans_removed": orphans, "stray": stray}

    @store_call
    def clean_orphans(self) -> dict:
        """Under the writers' lock: delete temporary files and entry files that have no row, by the
        names the store makes; other things (``stray``) are reported and left alone."""
        with self._writing() as db:
            known = {r[0] for r in db.execute("SELECT file FROM entries")}
            return self._clean_locked(known)

    @store_call
    def verify(self, progress: bool = False) -> dict:
        """Check every entry (a regular file of its recorded size, sha256, decodes), quarantine the
        damaged ones, clean orphans (under the writers' lock; skipped, with ``cleanup_skipped``
        saying why, when that stays busy past the time bound), and check that the index holds
        exactly the live entries (compared at one generation). ``report["damaged"]`` lists what
        this run quarantined; ``report["evicted"]`` the entries whose row went away while the run
        read them (evicted or removed by a worker: not damage); ``report["stray"]`` what the store
        did not make and left alone; ``report["unchecked"]`` the entries this machine had not the
        memory to decode (left as they are: not damage); ``report["ok"]`` is true when nothing was
        damaged. Safe beside busy workers: it waits for the writers' lock only to quarantine and to clean up.
        """
        with self._rmutex:
            rows = self._rdb.execute("SELECT id, file, sha256, meta_json, nbytes FROM entries ORDER BY id").fetchall()
        seams.workspace_phase("verify_listed")
        damaged, evicted, unchecked = [], [], []
        iterator = rows
        if progress:
            from tqdm import tqdm

            iterator = tqdm(rows, desc="verify", unit="entry")
        for entry_id, file, digest, meta_json, nbytes in iterator:
            try:
                data = self._read_checked(entry_id, (file, digest, meta_json, nbytes))
                self._decode_checked(entry_id, file, data, decode_entry_arrays)
            except EntryGone:
                evicted.append(entry_id)
            except CorruptEntryError as exc:
                damaged.append({"id": entry_id, "file": file, "reason": str(exc)})
            except MemoryError:
                unchecked.append({"id": entry_id, "file": file, "reason": "not enough memory to decode it"})
        cleaned = {"temp_files_removed": 0, "orphans_removed": 0, "stray": []}
        if self.readonly:
            cleaned["cleanup_skipped"] = "read-only: damaged entries are not quarantined, orphans are not removed"
        else:
            try:
                cleaned = self.clean_orphans()
            except StoreBusyError as exc:  # the checks above stand; only the cleanup waits for next time
                LOG.warning("verify of %s: orphan cleanup skipped: %s", self.path, exc)
                cleaned["cleanup_skipped"] = str(exc)
        consistent = self._index_matches()
        return {"checked": len(rows), "damaged": damaged, "evicted": evicted, "unchecked": unchecked,
                "ok": not damaged, "index_consistent": consistent, **cleaned}
