"""Headless ComfyUI servers (subprocesses, CPU, 127.0.0.1) as fleet workers on ONE PostgreSQL.

Each server is a separate "host": its own ComfyUI base folder and its own cache root
(``CHORUS_CACHE_DIR``: its local tier), and the same ``CHORUS_CACHE_URL`` (a throwaway cluster
from ``tests/fleet_pg.py``). The requests are the tiny ones of ``tests/serving_helpers.py``.
In file order:

1. a miss on server A is a hit on server B when queued right after A's commit, and the other way;
2. servers C and D start later and catch up (their first requests on A's and B's entries hit);
   then 4 servers x N requests (N = 20 by default, 50 with CHORUS_FLEET_REQUESTS_PER_SERVER=50):
   N/2 new templates each queued to all 4 servers at once (forced races), then N/2
   near-duplicates per server. Every prompt succeeds, each template is written
   exactly once fleet-wide, every entry reported written exists, all others are hits or dedupes;
3. PostgreSQL SIGKILLed while requests run, restarted later: no failed prompt (while it is down:
   hits from the local tier, or dense attention with a message), no partial entry, every entry
   reported written is there, the workers reconnect by themselves (a miss on A is a hit on B
   again), ``python -m chorus cache verify --url`` is clean;
4. a fleet-wide entry cap set from outside applies at the servers' next writes (LRU).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

import fleet_pg
import serving_helpers as sh

SKIP = sh.skip_reason()
pytestmark = [pytest.mark.host, pytest.mark.skipif(SKIP is not None, reason=f"ComfyUI not available: {SKIP}")]

WS = "fleet"
# The issue asks for 4 servers x 50 requests (200: 25 race templates + 25 near-duplicates per
# server); on the 2-core CI machine that takes ~3 min, so the default is 4 x 20 (10 + 10).
# CHORUS_FLEET_REQUESTS_PER_SERVER=50 runs the full size.
PER_SERVER = int(os.environ.get("CHORUS_FLEET_REQUESTS_PER_SERVER", "20"))
RACE_TEMPLATES = list(range(701, 701 + PER_SERVER // 2))


def _wait(worker, prompt_id, timeout=300.0) -> dict:
    return sh.outcome(sh.wait_prompt(worker, prompt_id, timeout, poll=0.05))


def _run(worker, template, variant=0):
    return _wait(worker, sh.post_prompt(worker, sh.request_graph(template, variant, workspace=WS)))


def _start(base, root, url):
    comfy_dir = sh.tiny.find_comfyui_dir()
    return sh.hostlib.ComfyHost(comfy_dir, base, startup_timeout=240,
                                extra_env={"CHORUS_CACHE_DIR": str(root), "CHORUS_CACHE_URL": url})


class Fleet:
    def __init__(self, tmp, pg):
        self.tmp, self.pg = tmp, pg
        self.url = pg.url(pg.new_database("fleet"))
        self.unet = sh.write_tiny_unet(tmp / "tiny_unet.safetensors")
        self.servers: list = []

    def start(self, n):
        """Start ``n`` more servers at once, each with its own base folder and cache root."""
        first = len(self.servers)
        started, errors = [None] * n, []

        def go(i):
            try:
                host = first + i
                base = sh.prepare_worker_base(self.tmp / f"host{host}", self.unet)
                started[i] = _start(base, self.tmp / f"host{host}" / "chorus_cache", self.url)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.servers += [s for s in started if s is not None]
        if errors:
            pytest.fail(f"a ComfyUI server did not start: {errors[0]}")
        return self.servers[first:]

    def store(self):
        from chorus.cache_store.fleet import FleetStore

        return FleetStore.open(self.url, WS, local_path=self.tmp / "observer" / WS, listen=False)

    def logs(self):
        return "\n".join(s.log_tail(2000) for s in self.servers)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pg = fleet_pg.require()
    f = Fleet(tmp_path_factory.mktemp("fleet_serving"), pg)
    f.start(2)
    yield f
    for s in f.servers:
        s.stop()
    fleet_pg.stop()


def test_miss_on_one_server_is_a_hit_on_the_other(fleet):
    a, b = fleet.servers[:2]
    for writer, reader, template in [(a, b, 601), (b, a, 602)]:
        wrote = _run(writer, template)
        committed = time.monotonic()  # the entry was committed before the writer's prompt finished
        assert wrote["status"] == "success" and wrote["wrote"] is not None, wrote
        prompt_id = sh.post_prompt(reader, sh.request_graph(template, 1, workspace=WS))
        assert time.monotonic() - committed < 1.0
        hit = _wait(reader, prompt_id)
        assert hit["status"] == "success" and hit["hit_entry"] == wrote["wrote"], (hit, wrote, fleet.logs())
        assert hit["write"].startswith("hit: updated stats"), hit


def test_four_servers_with_forced_races(fleet):
    c, d = fleet.start(2)  # started later: they catch up with what A and B wrote
    for server, template in [(c, 601), (d, 602)]:
        out = _run(server, template, 5)
        assert out["hit"], (out, server.log_tail())
    servers = fleet.servers[:4]
    # phase 1: every template queued to all 4 servers at once; each server works through the same order
    posted = []
    for template in RACE_TEMPLATES:
        for i, server in enumerate(servers):
            posted.append(((i, template, 0), sh.post_prompt(server, sh.request_graph(template, 0, workspace=WS))))
    results = [(req, _wait(servers[req[0]], pid)) for req, pid in posted]
    # phase 2: 25 near-duplicates per server, all queued at once
    posted = []
    variant = 10
    for i, server in enumerate(servers):
        shift = i * 7 % len(RACE_TEMPLATES)
        for template in RACE_TEMPLATES[shift:] + RACE_TEMPLATES[:shift]:
            posted.append(((i, template, variant), sh.post_prompt(server, sh.request_graph(template, variant, workspace=WS))))
            variant += 1
    phase2 = [(req, _wait(servers[req[0]], pid)) for req, pid in posted]
    results += phase2
    total = 4 * 2 * len(RACE_TEMPLATES)
    assert len(results) == total
    failed = [(req, out) for req, out in results if out["status"] != "success"]
    assert not failed, (failed[:3], fleet.logs())
    writes: dict[int, list] = {}
    for (i, template, _), out in results:
        if out["wrote"] is not None:
            writes.setdefault(template, []).append(out["wrote"])
    assert {t: len(w) for t, w in writes.items()} == {t: 1 for t in RACE_TEMPLATES}, writes
    deduped = [out for _, out in results if "already serves this request" in out["write"]]
    hits = [out for _, out in results if out["hit"]]
    assert len(hits) + len(writes) + len(deduped) == total, [out for _, out in results
                                                          if not out["hit"] and out["wrote"] is None][:3]
    assert all(out["hit"] for _, out in phase2)
    with fleet.store() as store:
        entries = {e["id"]: e for e in store.entries()}
        by_prompt = {e["meta"]["prompt"]: e["id"] for e in entries.values()}
        for template, (entry_id,) in writes.items():
            assert by_prompt[f"template {template}"] == entry_id  # nothing lost, nothing doubled
        assert len(entries) == len(RACE_TEMPLATES) + 2
        assert sum(e["hits"] for e in entries.values()) == len(hits) + 4  # + tests 1 and 2's four hits
    print(f"fleet: {total} requests on 4 servers: {len(writes)} entries written, {len(hits)} hits, "
          f"{len(deduped)} concurrent misses deduplicated fleet-wide")


def test_postgres_sigkilled_while_serving(fleet):
    a, b = fleet.servers[:2]
    pg = fleet.pg
    # 3 new templates queued on each server; once the first of each has committed, the server dies
    # with the others queued or running (misses on their way to a commit)
    posted = [(s, t, sh.post_prompt(s, sh.request_graph(t, 0, workspace=WS))) for t in range(801, 807)
              for s in ([a] if t % 2 else [b])]
    first = {s: pid for s, _, pid in reversed(posted)}  # each server's first prompt
    for s, pid in first.items():
        _wait(s, pid)
    pg.kill()
    try:
        down = [(b, 601, 40), (a, 602, 41), (a, 811, 0), (b, 812, 0)]  # tier hits; misses with no store
        posted_down = [(s, t, sh.post_prompt(s, sh.request_graph(t, v, workspace=WS))) for s, t, v in down]
        during = [(t, _wait(s, pid)) for s, t, pid in posted + posted_down]
    finally:
        pg.start()
    failed = [(t, out) for t, out in during if out["status"] != "success"]
    assert not failed, (failed, fleet.logs())
    tier_hits = {t: out for t, out in during[-4:-2]}
    assert all(out["hit"] for out in tier_hits.values()), tier_hits
    for _, out in during[-2:]:
        assert not out["hit"] and out["write"].startswith("not written"), out
        assert "PostgreSQL" in out["write"] and "StoreUnavailableError" in out["write"], out
    reported = {out["wrote"]: t for t, out in during if out["wrote"] is not None}
    assert len(reported) >= 2, during  # at least the first of each server
    with fleet.store() as store:
        entries = {e["id"]: e["meta"]["prompt"] for e in store.entries()}
        for entry_id, template in reported.items():
            assert entries.get(entry_id) == f"template {template}", (entry_id, template)  # never lost
        report = store.verify()
        assert report["ok"] and report["index_consistent"], report  # no partial entry
    # the servers reconnect by themselves: a miss on A becomes a hit on B again
    wrote = _run(a, 821)
    assert wrote["wrote"] is not None, (wrote, a.log_tail())
    deadline = time.monotonic() + 15
    while True:
        out = _run(b, 821, 1)
        assert out["status"] == "success"
        if out["hit"]:
            assert out["hit_entry"] == wrote["wrote"]
            break
        assert time.monotonic() < deadline, (out, b.log_tail())
        time.sleep(0.5)
    done = sh.chorus_cli("cache", "verify", "--url", fleet.url, "--workspace", WS, "--root",
                         str(fleet.tmp / "cli_root"), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["ok"], done.stdout + done.stderr
    print(f"fleet: PostgreSQL SIGKILLed with {len(posted)} requests in flight and {len(down)} queued while down: "
          f"{len(reported)} entries reported written (all present), "
          + "; ".join(sorted({out["write"][:90] for _, out in during if out["wrote"] is None})))


def test_fleet_wide_cap_applies_at_the_next_writes(fleet):
    """A cap set from outside (the operator) applies at the servers' next writes: LRU victims."""
    a, b = fleet.servers[:2]
    with fleet.store() as store:
        before = store.entries()
        cap = len(before)
        store.set_limits(max_entries=cap, eviction="lru")
        lru = sorted(before, key=lambda e: (e["last_used"], e["id"]))[:4]  # new misses touch nothing
        written = []
        for n, template in enumerate(range(901, 905)):
            out = _run((a, b)[n % 2], template)
            assert out["wrote"] is not None, out
            written.append(out["wrote"])
            live = {e["id"] for e in store.entries()}
            assert len(live) == cap and written[-1] in live
        gone = {e["id"] for e in before} - live
        assert gone == {e["id"] for e in lru}, (gone, lru)
    template = int(lru[0]["meta"]["prompt"].split()[1])
    for server in (a, b):  # the evicted entry is gone from both servers' indexes: a clean miss
        out = _run(server, template, 99)
        assert out["status"] == "success" and out["hit_entry"] != lru[0]["id"], out
