"""Two headless ComfyUI workers (subprocesses, CPU, 127.0.0.1) serving from ONE Chorus cache.

Each worker has its own ComfyUI base folder (models, user, output, temp); both point
``CHORUS_CACHE_DIR`` at the same cache root, so workspace ``serving`` is one directory shared
by two processes. 40 tiny requests (``tests/serving_helpers.py``) are queued alternately to the
two workers:

1. race round: the same 5 new templates are queued to BOTH workers at once, so both workers miss
   on the same request at the same time;
2. 30 more requests, all queued at once alternately: near-duplicate variants of those templates
   (hits, many served from an entry the other worker wrote) and 5 new templates, each asked of
   both workers.

Checks: every prompt succeeds; the workspace ends with exactly one entry per template (each
distinct miss written once: concurrent misses are deduplicated under the writer lock by
``Workspace.add_unique``); the number of "wrote entry" answers equals the number of templates;
some hits come from entries the other worker wrote; ``python -m chorus cache verify`` exits 0
and reports no damage, and the index holds exactly the live entries.

Soak (worker 0, workspace ``soak``, after the test above or alone): 200 requests in a row
through the API queue (posted in batches of 10), a mix of near-duplicates of 4 hot templates
(hits) and 20 cold ones (misses), with the workspace capped at about 8 entries' bytes. Checks: no
failed prompt; the worker's resident memory (psutil RSS) grows by under 5% from the end of the
warm-up (first 50 requests) to the end; the workspace stays within its byte cap after every batch
and evicted entries (more entries written than are left).

The host tests skip with a visible reason without a ComfyUI checkout (COMFYUI_DIR, /opt/ComfyUI,
or the folder above custom_nodes/). ``test_add_unique_across_processes`` needs no ComfyUI.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import threading
import time

import pytest

import serving_helpers as sh

SKIP = sh.skip_reason()

RACE_TEMPLATES = [101, 102, 103, 104, 105]
NEW_TEMPLATES = [201, 202, 203, 204, 205]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving_two")
    unet = sh.write_tiny_unet(tmp / "tiny_unet.safetensors")
    cache_root = tmp / "shared_cache"
    cache_root.mkdir()
    bases = [sh.prepare_worker_base(tmp / f"worker{i}", unet) for i in range(2)]
    started, errors = [None, None], []

    def start(i):
        try:
            started[i] = sh.start_worker(bases[i], cache_root)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for w in started:
            if w is not None:
                w.stop()
        pytest.fail(f"a ComfyUI worker did not start: {errors[0]}")
    yield started, cache_root
    for w in started:
        w.stop()


@pytest.mark.host
@pytest.mark.skipif(SKIP is not None, reason=f"ComfyUI not available: {SKIP}")
def test_two_workers_share_one_cache(workers):
    servers, cache_root = workers
    # (worker index, template, variant) in queue order, alternating workers
    race = []
    for template in RACE_TEMPLATES:
        race += [(0, template, 0), (1, template, 0)]
    rest = []
    variant = 1
    for round_ in range(4):
        for template in RACE_TEMPLATES:
            rest.append((len(rest) % 2, template, variant))
            variant += 1
    for template in NEW_TEMPLATES:
        rest += [(len(rest) % 2, template, 0), ((len(rest) + 1) % 2, template, variant)]
        variant += 1
    assert len(race) + len(rest) == 40

    results = []
    # race round: each template posted to both workers back to back, then wait for both
    for i in range(0, len(race), 2):
        ids = [(race[j], sh.post_prompt(servers[race[j][0]], sh.request_graph(race[j][1], race[j][2]))) for j in (i, i + 1)]
        results += [(req, sh.outcome(sh.wait_prompt(servers[req[0]], pid))) for req, pid in ids]
    # the rest: everything queued at once, alternately; both workers run concurrently
    ids = [(req, sh.post_prompt(servers[req[0]], sh.request_graph(req[1], req[2]))) for req in rest]
    results += [(req, sh.outcome(sh.wait_prompt(servers[req[0]], pid))) for req, pid in ids]

    failed = [(req, out) for req, out in results if out["status"] != "success"]
    assert not failed, f"failed prompts: {failed[:3]}\n{servers[0].log_tail()}\n{servers[1].log_tail()}"

    writer_of = {}  # entry id -> worker index that wrote it
    writes_per_template: dict[int, int] = {}
    for (worker, template, _), out in results:
        if out["wrote"] is not None:
            writer_of[out["wrote"]] = worker
            writes_per_template[template] = writes_per_template.get(template, 0) + 1
    templates = RACE_TEMPLATES + NEW_TEMPLATES
    assert writes_per_template == {t: 1 for t in templates}, writes_per_template

    deduped = [out["write"] for _, out in results if "already serves this request" in out["write"]]
    hits = [(worker, out["hit_entry"]) for (worker, _, _), out in results if out["hit"]]
    cross_hits = [h for h in hits if writer_of.get(h[1]) not in (None, h[0])]
    misses_not_written = [out for _, out in results if not out["hit"] and out["wrote"] is None]
    assert len(misses_not_written) == len(deduped), misses_not_written[:3]
    assert len(hits) + len(writer_of) + len(deduped) == 40
    assert cross_hits, f"no hit was served from the other worker's entry: {hits}"
    # every variant request of a race template found its entry (written before the rest was queued)
    assert all(out["hit"] for (_, t, v), out in results if t in RACE_TEMPLATES and v > 0)

    from chorus.cache_store import Workspace, resolve_workspace

    ws_dir = resolve_workspace(sh.WORKSPACE, cache_root)
    with Workspace.open(ws_dir) as ws:
        entries = ws.entries()
        prompts = sorted(e["meta"]["prompt"] for e in entries)
        assert prompts == sorted(f"template {t}" for t in templates), prompts
        assert sorted(e["id"] for e in entries) == sorted(writer_of)
        hits_recorded = sum(e["hits"] for e in entries)
        assert hits_recorded == len(hits), (hits_recorded, len(hits))

    done = sh.chorus_cli("cache", "verify", "--workspace", sh.WORKSPACE, "--json", env_root=cache_root)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["index_consistent"] and report["checked"] == len(templates), report
    assert report["orphans_removed"] == 0 and report["temp_files_removed"] == 0, report
    print(f"serving: 40 requests on 2 workers: {len(writer_of)} entries written, {len(hits)} hits "
          f"({len(cross_hits)} from the other worker's entries), {len(deduped)} concurrent misses deduplicated")

    # worker 1 killed (SIGKILL) while it works through 3 new requests: worker 0 goes on serving,
    # the cache verifies clean (at most temporary/orphan files to remove), no template twice
    victim = servers[1]
    for template in (501, 502, 503):
        sh.post_prompt(victim, sh.request_graph(template, 0))
    time.sleep(1.0)
    victim.proc.kill()
    victim.proc.wait(30)
    after = sh.outcome(servers[0].queue(sh.request_graph(501, 77)))
    assert after["status"] == "success" and (after["hit"] or after["wrote"] is not None), after
    done = sh.chorus_cli("cache", "verify", "--workspace", sh.WORKSPACE, "--json", env_root=cache_root)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["index_consistent"], report
    with Workspace.open(ws_dir) as ws:
        prompts = [e["meta"]["prompt"] for e in ws.entries()]
        assert len(prompts) == len(set(prompts)) and set(prompts) >= {f"template {t}" for t in templates}, prompts


SOAK_REQUESTS = 200
SOAK_BATCH = 10
SOAK_WARMUP = 50
SOAK_CAP_ENTRIES = 8
HOT_TEMPLATES = [301, 302, 303, 304]
COLD_TEMPLATES = list(range(401, 421))


def _rss(worker) -> int:
    import psutil

    return psutil.Process(worker.proc.pid).memory_info().rss


@pytest.mark.host
@pytest.mark.slow
@pytest.mark.skipif(SKIP is not None, reason=f"ComfyUI not available: {SKIP}")
def test_soak_one_worker(workers):
    servers, cache_root = workers
    worker = servers[0]
    from chorus.cache_store import Workspace, resolve_workspace

    rng = random.Random(7)
    schedule = [(rng.choice(HOT_TEMPLATES) if rng.random() < 0.5 else rng.choice(COLD_TEMPLATES), i + 1)
                for i in range(SOAK_REQUESTS)]
    ws = Workspace.open(resolve_workspace("soak", cache_root))
    cap = None
    outcomes, rss, sizes = [], [], []
    try:
        for start in range(0, SOAK_REQUESTS, SOAK_BATCH):
            batch = schedule[start:start + SOAK_BATCH]
            ids = [sh.post_prompt(worker, sh.request_graph(t, v, workspace="soak")) for t, v in batch]
            for pid in ids:
                out = sh.outcome(sh.wait_prompt(worker, pid))
                assert out["status"] == "success", f"request failed: {out}\n{worker.log_tail()}"
                outcomes.append(out)
            if cap is None:
                # the cap is about SOAK_CAP_ENTRIES entries' bytes, measured on the first entries
                # (the worker reads the limits from SQLite at every write)
                largest = max(e["nbytes"] for e in ws.entries())
                cap = int(largest * (SOAK_CAP_ENTRIES + 0.5))
                ws.set_limits(max_bytes=cap)
                ws.prune()
            stats = ws.stats()
            sizes.append((stats["entries"], stats["bytes"]))
            assert stats["bytes"] <= cap, (stats["bytes"], cap)
            rss.append((start + len(batch), _rss(worker)))
    finally:
        ws.close()

    written = sum(1 for o in outcomes if o["wrote"] is not None)
    hits = sum(1 for o in outcomes if o["hit"])
    final_entries = sizes[-1][0]
    assert len(outcomes) == SOAK_REQUESTS
    assert hits >= SOAK_REQUESTS // 4 and written >= SOAK_REQUESTS // 8, (hits, written)
    assert final_entries <= SOAK_CAP_ENTRIES and written > final_entries, (written, sizes[-1])  # eviction seen
    baseline = next(value for done, value in rss if done >= SOAK_WARMUP)
    final = rss[-1][1]
    growth = (final - baseline) / baseline
    peak = max(value for done, value in rss if done >= SOAK_WARMUP)
    print(f"soak: {SOAK_REQUESTS} requests, {hits} hits, {written} written, {final_entries} entries left "
          f"(cap {cap} bytes), RSS after warm-up {baseline / 2**20:.1f} MiB, final {final / 2**20:.1f} MiB "
          f"({growth:+.2%}), peak {peak / 2**20:.1f} MiB; samples {[round(v / 2**20, 1) for _, v in rss]}")
    assert growth < 0.05, f"RSS grew {growth:.2%} after warm-up: {rss}"


def test_add_unique_across_processes(tmp_path):
    """Two processes add the same 5 requests at the same moments: 5 entries, each written once."""
    from chorus.cache_store import Workspace

    path = tmp_path / "ws"
    Workspace.open(path).close()
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=sh.unique_writer, args=(str(path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    by_round = {}
    for created in got:
        for round_, entry_id, new in created:
            by_round.setdefault(round_, []).append((entry_id, new))
    for round_, pair in by_round.items():
        assert sorted(new for _, new in pair) == [False, True], (round_, pair)  # one wrote, one found it
        assert pair[0][0] == pair[1][0]  # both name the same entry
    with Workspace.open(path) as ws:
        assert len(ws) == 5 and sorted(e["meta"]["round"] for e in ws.entries()) == [0, 1, 2, 3, 4]


def _recorded_miss(ws, seed):
    """A miss plan whose attention was recorded for every (step, layer) of the tiny signature."""
    from chorus.engine import retrieve_plan

    plan = retrieve_plan(ws, sh.embedding(seed), sh.LATENT, similarity_threshold=0.9)
    assert not plan.is_hit
    return sh.record_miss(plan, seed)


@pytest.mark.parametrize("phase", ["temp_written", "before_commit"])
def test_full_disk_is_a_message_not_a_failed_request(tmp_path, monkeypatch, phase):
    """ENOSPC while an entry is written (the file data, or the SQLite commit: the two places a full
    disk can fail a write; the rename and the directory fsync do not allocate): the
    request gets "not written: ... No space left on device", the workspace keeps its entries, holds
    no partial file and verifies clean; once space is back the next miss is written."""
    import errno

    from chorus.cache_store import Workspace, seams
    from chorus.engine import commit_plan

    ws = Workspace.open(tmp_path / "ws")
    assert commit_plan(ws, _recorded_miss(ws, 1)).startswith("wrote entry 1")

    def full_disk(where):
        if where == phase:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(seams, "workspace_phase", full_disk)
    message = commit_plan(ws, _recorded_miss(ws, 2))
    assert message.startswith("not written") and "No space left on device" in message, message
    assert len(ws) == 1 and [p.name for p in (tmp_path / "ws" / "entries").iterdir()] == [ws.entry_path(1).name]
    report = ws.verify()
    assert report["ok"] and report["index_consistent"] and report["orphans_removed"] == 0, report
    monkeypatch.setattr(seams, "workspace_phase", lambda where: None)
    assert commit_plan(ws, _recorded_miss(ws, 3)).startswith("wrote entry")
    assert len(ws) == 2 and set(ws.load(1, touch=False)[0]) == set(sh.entry_masks(1))
    ws.close()


def test_backup_procedure_of_operations_md(tmp_path):
    """docs/OPERATIONS.md backup: SQLite online backup, then copy entries/, then ``verify --repair --path``:
    entries written after the snapshot become orphans in the copy and are removed; every entry of
    the snapshot loads from the backup."""
    import shutil
    import sqlite3

    from chorus.cache_store import Workspace

    src = tmp_path / "live" / "default"
    dst = tmp_path / "backup" / "default"
    with Workspace.open(src) as ws:
        ids = [ws.add(sh.embedding(i), sh.entry_masks(i), {"signature": sh.signature()}) for i in range(3)]
        (dst / "entries").mkdir(parents=True)
        live, copy = sqlite3.connect(str(src / "chorus.sqlite3")), sqlite3.connect(str(dst / "chorus.sqlite3"))
        live.backup(copy)
        copy.close()
        live.close()
        ws.add(sh.embedding(9), sh.entry_masks(9), {"signature": sh.signature()})  # after the snapshot
        shutil.copytree(src / "entries", dst / "entries", dirs_exist_ok=True)
    done = sh.chorus_cli("cache", "verify", "--repair", "--path", str(dst), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["checked"] == 3 and report["orphans_removed"] == 1, report
    with Workspace.open(dst) as ws:
        assert sorted(e["id"] for e in ws.entries()) == ids
        assert all(set(ws.load(i, touch=False)[0]) == set(sh.entry_masks(i)) for i in ids)
        assert ws.search(sh.embedding(1), k=1)[0][0] == ids[1]
