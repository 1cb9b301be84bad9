"""The fleet store's tables and the one check of the rows read back from them.

Tables (created on first use, or beforehand by an owner role: docs/OPERATIONS.md "Fleet"):
``chorus_workspaces`` (one row per workspace: the change sequence number, the sequence number the
change log was trimmed to, embedding dim, entry count and bytes, limits; locking this row is the
fleet-wide writer lock), ``chorus_entries`` (metadata, embedding and the entry bytes, ``bytea``
with ``STORAGE EXTERNAL``: the entry format of ``entry_format.py``, already compressed, with their
sha256), ``chorus_changes`` (the change log: ``(workspace, seq, op, entry_id)``, ``op`` ``a``\\ dd
or ``r``\\ emove) and ``chorus_quarantine``.

Trust: the tables are writable by every worker, and a worker may be buggy or compromised, so every
row is checked like a file before its bytes are copied (:func:`row_columns`, :func:`check_row`,
the same checks as a local entry in ``rows.py``): declared sizes against the columns' lengths in
SQL (data, embedding, metadata, keys; a column that fails is never fetched), the embedding
dimension from the workspace row, finite and normalisable embeddings, hex sha256 and signature
keys (the local tier's file names), finite timestamps, metadata depth and size; a load and
verify also check the bytes (:func:`entry_problem`: sha256, decoding, the embedding and
signature inside the entry against the row's). Tested in
``tests/test_fleet_hostile.py`` (rows written straight into the tables) and
``tests/test_fleet_store.py`` (the least-privilege SQL of docs/OPERATIONS.md as written).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from .entries import DEFAULT_MAX_BYTES, MAX_ENTRY_FILE_BYTES, RUN_COUNTERS
from .entry_format import MAX_META_BYTES, EntryFormatError
from .fleet_conn import psycopg_module
from .rows import (DIGEST_CHARS, MAX_EMBEDDING_DIM, SIG_KEY_CHARS, check_embedding, check_entry_matches_row,
                   finite_number, is_digest, is_sig_key)

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS chorus_workspaces(
        name TEXT PRIMARY KEY,
        seq BIGINT NOT NULL DEFAULT 0,
        trimmed_seq BIGINT NOT NULL DEFAULT 0,
        dim INTEGER,
        n_entries BIGINT NOT NULL DEFAULT 0,
        n_bytes BIGINT NOT NULL DEFAULT 0,
        max_bytes BIGINT NOT NULL DEFAULT %d,
        max_entries BIGINT NOT NULL DEFAULT 0,
        eviction TEXT NOT NULL DEFAULT 'lru')""" % DEFAULT_MAX_BYTES,
    """CREATE TABLE IF NOT EXISTS chorus_entries(
        id BIGSERIAL PRIMARY KEY,
        workspace TEXT NOT NULL REFERENCES chorus_workspaces(name),
        sig_key TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        nbytes BIGINT NOT NULL,
        embedding BYTEA NOT NULL,
        meta_json TEXT NOT NULL,
        data BYTEA NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        last_used DOUBLE PRECISION NOT NULL,
        hits BIGINT NOT NULL DEFAULT 0,
        sparse_calls BIGINT NOT NULL DEFAULT 0,
        tail_calls BIGINT NOT NULL DEFAULT 0,
        fallback_calls BIGINT NOT NULL DEFAULT 0)""",
    "ALTER TABLE chorus_entries ALTER COLUMN data SET STORAGE EXTERNAL",
    "CREATE INDEX IF NOT EXISTS chorus_entries_lru ON chorus_entries(workspace, last_used, id)",
    """CREATE TABLE IF NOT EXISTS chorus_changes(
        workspace TEXT NOT NULL,
        seq BIGINT NOT NULL,
        op CHAR(1) NOT NULL,
        entry_id BIGINT NOT NULL,
        time DOUBLE PRECISION NOT NULL,
        PRIMARY KEY(workspace, seq))""",
    """CREATE TABLE IF NOT EXISTS chorus_quarantine(
        workspace TEXT NOT NULL,
        entry_id BIGINT,
        reason TEXT NOT NULL,
        time DOUBLE PRECISION NOT NULL,
        sig_key TEXT,
        meta_json TEXT,
        data BYTEA)""",
]
SCHEMA_LOCK = 0x63686F72  # advisory lock id serialising schema creation ("chor")


def setup(conn, workspace: str, url: str, create: bool) -> None:
    """Create the tables and register ``workspace`` (``create``), else check that they exist:
    a ``ValueError`` that created nothing when they do not. ``url`` (redacted) names the database
    in messages. Schema creation is serialised fleet-wide by an advisory lock."""
    psycopg = psycopg_module()
    exists = conn.execute("SELECT to_regclass('chorus_changes') IS NOT NULL").fetchone()[0]
    if not exists:
        if not create:
            raise ValueError(f"the database of {url} holds no Chorus fleet tables; nothing was created "
                             "(workers create them on first use, or: python -m chorus cache init --url ...)")
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            if not conn.execute("SELECT to_regclass('chorus_changes') IS NOT NULL").fetchone()[0]:
                try:
                    for statement in SCHEMA:
                        conn.execute(statement)
                except psycopg.errors.InsufficientPrivilege:
                    raise ValueError("the chorus tables do not exist and this role may not create them: "
                                     "run the schema SQL of docs/OPERATIONS.md (Fleet) as the owner role") from None
    registered = conn.execute("SELECT 1 FROM chorus_workspaces WHERE name=%s", (workspace,)).fetchone()
    if registered is None:
        if not create:
            raise ValueError(f"fleet workspace {workspace!r} does not exist at {url}; nothing was "
                             "created (workers create it on first use, or: python -m chorus cache init)")
        with conn.transaction():
            conn.execute("INSERT INTO chorus_workspaces(name) VALUES(%s) ON CONFLICT (name) DO NOTHING",
                         (workspace,))


def run_columns(conn, add: bool) -> bool:
    """Whether ``chorus_entries`` has the run stats columns (:data:`~chorus.cache_store.entries.RUN_COUNTERS`,
    summed per entry by ``touch(entry_id, run=)``). Tables made before them get them when ``add`` and the
    role may alter the table (serialised by the schema lock; 0 for hits counted before); else False, and
    the handle counts hits without run stats."""
    psycopg = psycopg_module()

    def present() -> bool:
        found = conn.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'chorus_entries'::regclass "
                             "AND attname = ANY(%s) AND NOT attisdropped", (list(RUN_COUNTERS),)).fetchone()[0]
        return found == len(RUN_COUNTERS)

    if present():
        return True
    if not add:
        return False
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            for name in RUN_COUNTERS:
                conn.execute(f"ALTER TABLE chorus_entries ADD COLUMN IF NOT EXISTS {name} BIGINT NOT NULL DEFAULT 0")
    except psycopg.errors.InsufficientPrivilege:
        return False
    return present()


class Row(NamedTuple):
    """One ``chorus_entries`` row as :func:`row_columns` selects it: columns that failed their
    size guard in SQL (and those not asked for) are None and were never fetched."""

    id: int | None
    sig_key: str | None
    sha256: str | None
    nbytes: int | None
    data_len: int | None
    emb_len: int | None
    created: float | None
    last_used: float | None
    hits: int | None
    sparse_calls: int | None  # the run stats (entries.RUN_COUNTERS, in that order): None unless asked for
    tail_calls: int | None
    fallback_calls: int | None
    embedding: bytes | None
    meta_len: int | None
    meta_json: str | None
    data: bytes | None

    @property
    def runs(self) -> tuple:
        """The run stats, in :data:`~chorus.cache_store.entries.RUN_COUNTERS` order (None each unless asked for)."""
        return tuple(getattr(self, name) for name in RUN_COUNTERS)


def row_columns(alias: str = "e", *, embedding: bool = False, meta: bool = False, data: bool = False,
                runs: bool = False, runs_in_table: bool = True) -> str:
    """The select list of :class:`Row` for table alias ``alias`` (one shape whatever is asked). Each
    variable-length column comes only when its length is one the store writes (checked in SQL, so a
    hostile length costs nothing): the signature key and sha256 of their hex lengths; the embedding
    when ``embedding`` and its length lies in ``[%(emb_min)s, %(emb_max)s]`` (named parameters the
    caller passes, see :func:`emb_params`); metadata up to ``MAX_META_BYTES`` when ``meta``; the data
    when ``data`` and its length is the row's ``nbytes``, at most ``MAX_ENTRY_FILE_BYTES``. The run
    stats when ``runs``: the columns, or zeros when not ``runs_in_table`` (a table made before them
    that this role could not alter, :func:`run_columns` False)."""
    e = alias
    if not runs:
        counters = ["NULL::bigint"] * len(RUN_COUNTERS)
    elif runs_in_table:
        counters = [f"{e}.{name}" for name in RUN_COUNTERS]
    else:
        counters = [f"0::bigint AS {name}" for name in RUN_COUNTERS]
    return ", ".join([
        f"{e}.id",
        f"CASE WHEN octet_length({e}.sig_key) = {SIG_KEY_CHARS} THEN {e}.sig_key END",
        f"CASE WHEN octet_length({e}.sha256) = {DIGEST_CHARS} THEN {e}.sha256 END",
        f"{e}.nbytes", f"octet_length({e}.data)", f"octet_length({e}.embedding)",
        f"{e}.created", f"{e}.last_used", f"{e}.hits", *counters,
        f"CASE WHEN octet_length({e}.embedding) BETWEEN %(emb_min)s AND %(emb_max)s THEN {e}.embedding END"
        if embedding else "NULL::bytea",
        f"octet_length({e}.meta_json)",
        f"CASE WHEN octet_length({e}.meta_json) <= {MAX_META_BYTES} THEN {e}.meta_json END" if meta else "NULL::text",
        f"CASE WHEN octet_length({e}.data) = {e}.nbytes AND {e}.nbytes <= {MAX_ENTRY_FILE_BYTES} THEN {e}.data END"
        if data else "NULL::bytea",
    ])


def emb_params(dim: int | None) -> dict:
    """The embedding length guard of :func:`row_columns` for a workspace of ``dim`` (any valid
    dimension when None: the row is then refused by :func:`check_row` for want of a dim)."""
    return {"emb_min": 4 * dim, "emb_max": 4 * dim} if dim else {"emb_min": 4, "emb_max": 4 * MAX_EMBEDDING_DIM}


def check_row(row: Row, dim: int | None, *, embedding: bool = False) -> np.ndarray | None:
    """The one check of a row's fields, for every path that reads rows (open, feed, load, verify,
    listing): a signature key and sha256 in hex (``rows.is_sig_key``, ``rows.is_digest``), a size the
    store writes equal to the data column's length, finite timestamps, a hit count and, where
    selected, run stats that are counts; with ``embedding`` also the embedding (a vector of the
    workspace's ``dim`` that normalises, ``rows.check_embedding``), returned as float32. Raises
    ``ValueError`` with the reason."""
    if not is_sig_key(row.sig_key):
        raise ValueError(f"row signature key is not {SIG_KEY_CHARS} hex digits")
    if not is_digest(row.sha256):
        raise ValueError(f"row sha256 is not {DIGEST_CHARS} hex digits")
    if not isinstance(row.nbytes, int) or not 0 < row.nbytes <= MAX_ENTRY_FILE_BYTES:
        raise ValueError(f"row nbytes {row.nbytes!r} is not a size the store writes")
    if row.data_len != row.nbytes:
        raise ValueError(f"row data has {row.data_len} bytes, its nbytes says {row.nbytes}")
    if not finite_number(row.created) or not finite_number(row.last_used) or not isinstance(row.hits, int):
        raise ValueError("row timestamps or hit count are not finite numbers")
    if not all(count is None or isinstance(count, int) for count in row.runs):
        raise ValueError("row run stats are not counts")
    if not embedding:
        return None
    if dim is None:
        raise ValueError("the workspace states no embedding dimension")
    if row.embedding is None:
        raise ValueError(f"row embedding has {row.emb_len} bytes, expected {4 * dim}")
    return check_embedding(row.embedding, dim)


def own_row(entry_id: int, new) -> Row:
    """The :class:`Row` of an entry this handle just wrote (``entries.NewEntry``)."""
    return Row(entry_id, new.sig_key, new.digest, len(new.data), len(new.data), new.embedding.nbytes,
               new.created, new.created, 0, 0, 0, 0, new.embedding.tobytes(), None, None, None)


def entry_problem(row: Row, dim: int | None, decode, announced: str | None = None):
    """The checks of a fetched row and its entry bytes, shared by ``load`` and ``verify``:
    ``(masks, meta)``, or a ``str`` saying why the row is damaged (``announced``: the sha256 the
    change feed announced for it). ``decode``: the entry decoder, ``bytes -> (masks, embedding, meta)``:
    ``functools.partial(decode_entry, packed=...)`` for a load, :func:`~.entry_format.decode_entry_arrays`
    for verify (every check of decoding, without torch; ``masks`` then its payloads). A ``MemoryError``
    while decoding leaves as it is (the machine is short of memory; the row passed its caps: not damage)."""
    if announced is not None and announced != row.sha256:
        return "row sha256 differs from the one its change announced"
    try:
        check_row(row, dim, embedding=True)
    except ValueError as exc:
        return str(exc)
    if hashlib.sha256(row.data).hexdigest() != row.sha256:
        return "sha256 mismatch"
    return decoded_entry(row.data, decode, row.sig_key, row.embedding)


def decoded_entry(data: bytes, decode, sig_key: str, row_embedding: bytes | None):
    """``(masks, meta)`` of entry bytes whose signature (and embedding) match the row's, or why not
    (``decode``: as :func:`entry_problem`)."""
    try:
        masks, emb, meta = decode(data)
        check_entry_matches_row(emb, meta, sig_key, row_embedding)
    except (EntryFormatError, ValueError, TypeError, RecursionError) as exc:  # MemoryError: the machine's, it leaves
        return f"undecodable: {exc}"
    return masks, meta
