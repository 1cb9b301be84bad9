"""Vector index of a workspace: one faiss index per compatibility signature.

Every partition is an ``IndexIDMap2`` (faiss ids are entry ids) over inner product on
L2-normalised vectors, so scores are cosine similarities. A partition is exact
(``IndexFlatIP``) while it holds fewer than ``approx_threshold`` vectors and switches to
``IndexHNSWFlat`` (inner product) past it; it switches back below half the threshold
(hysteresis). HNSW cannot delete, so removed ids become tombstones excluded from searches by an
``IDSelectorNot``; the partition is rebuilt when tombstones pass ``TOMBSTONE_REBUILD_SHARE``.

Partitioning by signature makes ``search(signature=...)`` exactly as exact (or as approximate)
as an unfiltered search: no post-filtering, no selectivity collapse. A search without a
signature merges the partitions' results.

Persistence: :meth:`PartitionedIndex.to_bytes` writes one safetensors file holding each
partition's ``faiss.serialize_index`` bytes with a sha256 each, plus the workspace generation it
matches; :meth:`from_bytes` checks them before deserialising (faiss would crash on corrupt bytes).
Results are ordered by similarity descending, then entry id ascending.
"""

from __future__ import annotations

import hashlib
import json
import logging

import faiss
import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

LOG = logging.getLogger(__name__)

INDEX_FORMAT = "chorus-index"
DEFAULT_APPROX_THRESHOLD = 10_000  # measured: a flat scan of 10k x 1024 floats takes ~1 ms here, HNSW ~0.5 ms
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 128
TOMBSTONE_REBUILD_SHARE = 0.2
NORM_SAFE = (1e-15, 1e15)  # float32 norms outside this range are taken again in float64 (normalise)


def normalise(vectors) -> np.ndarray:
    """float32 ``[n, d]`` rows scaled to unit L2 norm; a zero or non-finite row raises ``ValueError``.

    Rows whose float32 norm is tiny or huge (where squares under- or overflow float32, e.g. 48
    values of 1e-45) are normalised in float64, so they keep their direction instead of having
    a zero or infinite norm; other rows exactly as in float32."""
    x = np.array(vectors, dtype=np.float32, copy=True, ndmin=2)
    if not np.isfinite(x).all():
        raise ValueError("embedding holds NaN or inf")
    with np.errstate(over="ignore", under="ignore"):  # such rows are taken again below
        norms = np.linalg.norm(x, axis=1, keepdims=True)
    careful = ~((norms > NORM_SAFE[0]) & (norms < NORM_SAFE[1]))[:, 0]
    if careful.any():
        wide = x[careful].astype(np.float64)
        wide_norms = np.sqrt(np.einsum("ij,ij->i", wide, wide))[:, None]
        if (wide_norms == 0).any():
            raise ValueError("embedding has zero norm")
        x[careful] = (wide / wide_norms).astype(np.float32)
        norms[careful] = 1.0
    return np.ascontiguousarray(x / norms)


class _Partition:
    def __init__(self, dim: int, kind: str = "flat"):
        self.dim = dim
        self.kind = kind
        self.index = self._empty(kind)
        self.tombstones: set[int] = set()
        self._selector = None  # (IDSelectorBatch, IDSelectorNot) kept alive while used

    def _empty(self, kind):
        if kind == "flat":
            base = faiss.IndexFlatIP(self.dim)
        else:
            base = faiss.IndexHNSWFlat(self.dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        return faiss.IndexIDMap2(base)

    def all_ids(self) -> np.ndarray:
        return faiss.vector_to_array(self.index.id_map).astype(np.int64)

    def live_count(self) -> int:
        return self.index.ntotal - len(self.tombstones)

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, normalised vectors) of the live entries, in id order."""
        ids = self.all_ids()
        xb = self.index.index.reconstruct_n(0, self.index.ntotal) if self.index.ntotal else np.zeros((0, self.dim), np.float32)
        keep = np.array([i not in self.tombstones for i in ids], dtype=bool) if self.tombstones else np.ones(len(ids), bool)
        ids, xb = ids[keep], xb[keep]
        order = np.argsort(ids, kind="stable")
        return ids[order], np.ascontiguousarray(xb[order])

    def rebuild(self, kind: str) -> None:
        ids, xb = self.vectors()
        LOG.info("rebuilding %s partition as %s with %d vectors", self.kind, kind, len(ids))
        self.kind = kind
        self.index = self._empty(kind)
        self.tombstones = set()
        self._selector = None
        if len(ids):
            self.index.add_with_ids(xb, ids)

    def add(self, ids: np.ndarray, xb: np.ndarray, threshold: int) -> None:
        self.index.add_with_ids(xb, ids)
        if self.kind == "flat" and self.live_count() >= threshold:
            self.rebuild("hnsw")

    def remove(self, ids, threshold: int) -> None:
        if self.kind == "flat":
            self.index.remove_ids(faiss.IDSelectorBatch(np.asarray(ids, dtype=np.int64)))
            return
        self.tombstones.update(int(i) for i in ids)
        self._selector = None
        if self.live_count() < threshold // 2:
            self.rebuild("flat")
        elif len(self.tombstones) > TOMBSTONE_REBUILD_SHARE * max(1, self.index.ntotal):
            self.rebuild("hnsw")

    def search(self, q: np.ndarray, k: int, ef_search: int):
        n = self.live_count()
        if n <= 0:
            return np.zeros((1, 0), np.float32), np.zeros((1, 0), np.int64)
        k = min(k, n)
        if self.kind == "flat":
            return self.index.search(q, k)
        params = faiss.SearchParametersHNSW()
        params.efSearch = max(ef_search, k)
        if self.tombstones:
            if self._selector is None:
                batch = faiss.IDSelectorBatch(np.fromiter(self.tombstones, dtype=np.int64))
                self._selector = (batch, faiss.IDSelectorNot(batch))
            params.sel = self._selector[1]
        return self.index.search(q, k, params=params)


class PartitionedIndex:
    """Entry-id -> vector index partitioned by signature key (see the module docstring)."""

    def __init__(self, dim: int, approx_threshold: int = DEFAULT_APPROX_THRESHOLD, ef_search: int = HNSW_EF_SEARCH):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = int(dim)
        self.approx_threshold = int(approx_threshold)
        self.ef_search = int(ef_search)
        self.parts: dict[str, _Partition] = {}
        self.where: dict[int, str] = {}  # live entry id -> signature key
        self.owner = ""  # id of the workspace database a loaded file was written for

    def __len__(self) -> int:
        return len(self.where)

    def add(self, sig_key: str, ids, vectors) -> None:
        """Add entries (ids int64 ``[n]``, vectors ``[n, dim]``, normalised here)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        xb = normalise(vectors)
        if xb.shape != (len(ids), self.dim):
            raise ValueError(f"expected vectors of shape ({len(ids)}, {self.dim}), got {xb.shape}")
        dup = [int(i) for i in ids if int(i) in self.where]
        if dup:
            raise ValueError(f"entry ids already indexed: {dup[:5]}")
        part = self.parts.setdefault(sig_key, _Partition(self.dim))
        part.add(ids, xb, self.approx_threshold)
        for i in ids:
            self.where[int(i)] = sig_key


    def add_rows(self, rows) -> None:
        """Add ``(entry_id, sig_key, vector [dim])`` rows, one :meth:`add` per signature key."""
        groups: dict[str, tuple[list, list]] = {}
        for entry_id, sig_key, vec in rows:
            ids, vecs = groups.setdefault(sig_key, ([], []))
            ids.append(entry_id)
            vecs.append(vec)
        for key, (ids, vecs) in groups.items():
            self.add(key, np.array(ids, dtype=np.int64), np.stack(vecs))
    def remove(self, ids) -> None:
        by_part: dict[str, list[int]] = {}
        for i in ids:
            key = self.where.pop(int(i), None)
            if key is not None:
                by_part.setdefault(key, []).append(int(i))
        for key, part_ids in by_part.items():
            part = self.parts[key]
            part.remove(part_ids, self.approx_threshold)
            if part.live_count() == 0:
                del self.parts[key]

    def search(self, query, k: int = 1, sig_key: str | None = None) -> list[tuple[int, float]]:
        """Top ``k`` ``(entry_id, cosine similarity)``, best first; only partition ``sig_key`` if given."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = normalise(np.asarray(query, dtype=np.float32).reshape(1, -1))
        if q.shape[1] != self.dim:
            raise ValueError(f"query has dim {q.shape[1]}, the workspace index has dim {self.dim}")
        if sig_key is not None:
            parts = [self.parts[sig_key]] if sig_key in self.parts else []
        else:
            parts = list(self.parts.values())
        found = []
        # One query gains nothing from OpenMP; its thread pool only adds wake-up latency (and spins
        # against other processes on a busy machine). The setting is per calling thread.
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        try:
            for part in parts:
                sims, ids = part.search(q, k, self.ef_search)
                found.extend((int(i), float(s)) for s, i in zip(sims[0], ids[0]) if i >= 0)
        finally:
            faiss.omp_set_num_threads(threads)
        found.sort(key=lambda item: (-item[1], item[0]))
        return found[:k]

    def kinds(self) -> dict:
        return {key: {"kind": p.kind, "entries": p.live_count(), "tombstones": len(p.tombstones)}
                for key, p in self.parts.items()}

    # -- persistence -------------------------------------------------------------------------
    def to_bytes(self, generation: int, owner: str = "") -> bytes:
        """Serialise; ``owner`` (the workspace's id) lets a reader reject a file left by another database."""
        tensors, parts = {}, []
        for n, (key, part) in enumerate(sorted(self.parts.items())):
            blob = faiss.serialize_index(part.index)
            name = f"part_{n:05d}"
            tensors[name] = blob
            parts.append({"sig_key": key, "kind": part.kind, "tensor": name,
                          "sha256": hashlib.sha256(blob.tobytes()).hexdigest()})
        if not tensors:
            tensors["empty"] = np.zeros(0, dtype=np.uint8)
        meta = {"format": INDEX_FORMAT, "generation": str(int(generation)), "dim": str(self.dim), "owner": owner,
                "approx_threshold": str(self.approx_threshold), "parts": json.dumps(parts)}
        return st_save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, *, ef_search: int = HNSW_EF_SEARCH):
        """-> (index, generation). Raises ``ValueError`` on a corrupt or foreign file."""
        try:
            header_len = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + header_len])
            meta = header["__metadata__"]
            if meta.get("format") != INDEX_FORMAT:
                raise ValueError("not a Chorus index file")
            tensors = st_load(data)
            index = cls(int(meta["dim"]), int(meta["approx_threshold"]), ef_search)
            index.owner = meta.get("owner", "")
            for rec in json.loads(meta["parts"]):
                blob = tensors[rec["tensor"]]
                if hashlib.sha256(blob.tobytes()).hexdigest() != rec["sha256"]:
                    raise ValueError(f"index partition {rec['sig_key']} fails its checksum")
                part = _Partition(index.dim, rec["kind"])
                part.index = faiss.deserialize_index(blob)  # already the concrete type; downcast of a temporary would dangle
                if not isinstance(part.index, faiss.IndexIDMap2):
                    raise ValueError("index partition is not an IndexIDMap2")
                if part.index.d != index.dim:
                    raise ValueError("index partition has the wrong dimension")
                index.parts[rec["sig_key"]] = part
                for i in part.all_ids():
                    index.where[int(i)] = rec["sig_key"]
            return index, int(meta["generation"])
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"corrupt index file: {exc}") from exc
