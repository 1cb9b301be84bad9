"""Limits are validated in one place (``cache_store/limits.py``) that every caller goes through:
the workspace's ``set_limits`` / ``prune`` / eviction after a write, the command line and Chorus
Cache Maintenance. A negative, NaN, infinite, non-integral, absurd or non-numeric limit is a clear
error that deletes nothing; a prune to 0 needs ``--delete-all`` on the command line. (The fleet
store's side runs against PostgreSQL in ``tests/test_fleet_hostile.py``.)"""

from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest

from cache_helpers import SIGNATURE, embedding, small_masks, tree_snapshot
from chorus.cache_store import Workspace, cli
from chorus.cache_store.limits import MAX_LIMIT, check_limits, eviction_order, limit_value, parse_limit, pick_victims, \
    prune_targets

BAD_LIMITS = [-1, -(2**63), math.nan, math.inf, -math.inf, 1.5, MAX_LIMIT + 1, 2**70, True, None, "3", b"3", [3],
              object()]


def _filled(path, n=4) -> list[int]:
    with Workspace.open(path) as ws:
        return [ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE, "prompt": f"p{s}"}) for s in range(n)]


def test_limit_values_accepted_and_refused():
    assert limit_value(0, "x") == 0 and limit_value(np.int64(7), "x") == 7 and limit_value(3.0, "x") == 3
    assert limit_value(MAX_LIMIT, "x") == MAX_LIMIT and parse_limit(" 12 ", "x") == 12
    for bad in BAD_LIMITS:
        if bad is None:
            continue
        with pytest.raises(ValueError, match="max_entries"):
            limit_value(bad, "max_entries")
    for text in ("-1", "1e3", "1.5", "nan", "inf", "", "٣", "0x10", "+-1"):
        with pytest.raises(ValueError):
            parse_limit(text, "--max-entries")
    with pytest.raises(ValueError, match=">= 1"):
        check_limits(max_bytes=0)  # a stored byte cap of 0 would empty the cache at every write
    with pytest.raises(ValueError, match="eviction"):
        check_limits(eviction="fifo")
    assert check_limits(max_entries=0)["max_entries"] == 0  # stored: no entry cap
    assert prune_targets(None, 0) == (None, 0)  # a prune target: keep nothing


def test_eviction_order_and_victims_are_one_rule_for_both_stores():
    assert eviction_order("lru") == "last_used, id" and eviction_order("lfu") == "hits, last_used, id"
    with pytest.raises(ValueError, match="eviction must be one of"):
        eviction_order("fifo")
    rows = [(5, 40), (2, 30), (9, 50)]  # in eviction order
    assert pick_victims(rows, 3, 120, 100, None) == [5]  # 80 bytes left
    assert pick_victims(rows, 3, 120, 50, None) == [5, 2]
    assert pick_victims(rows, 3, 120, 1000, 1) == [5, 2]  # the entry cap
    assert pick_victims(rows, 3, 120, 0, None) == [5, 2, 9] and pick_victims(rows, 3, 120, 1000, None) == []


def test_bad_limits_delete_nothing_in_a_workspace(tmp_path):
    ids = _filled(tmp_path / "ws")
    with Workspace.open(tmp_path / "ws") as ws:
        for bad in BAD_LIMITS:
            for kwargs in ({"max_entries": bad}, {"max_bytes": bad}):
                if bad is None:
                    continue
                with pytest.raises(ValueError):
                    ws.prune(**kwargs)
                with pytest.raises(ValueError):
                    ws.set_limits(**kwargs)
        assert sorted(e["id"] for e in ws.entries()) == ids and ws.limits()["max_entries"] is None
        ws.set_limits(max_entries=np.int64(3))  # a numpy int is the int it is
        assert ws.limits()["max_entries"] == 3 and len(ws.prune()) == 1
        assert ws.prune(max_entries=0) == ids[1:] and len(ws) == 0  # an explicit 0 keeps nothing


def test_stored_limits_edited_badly_evict_nothing(tmp_path, caplog):
    """Settings edited by hand (a negative cap) make the next write evict nothing, logged; stats
    still answer and say why."""
    ids = _filled(tmp_path / "ws")
    db = sqlite3.connect(str(tmp_path / "ws" / "chorus.sqlite3"))
    db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES('max_entries', '-1')")
    db.commit()
    db.close()
    with Workspace.open(tmp_path / "ws") as ws:
        new = ws.add(embedding(9), small_masks(9), {"signature": SIGNATURE})
        assert sorted(e["id"] for e in ws.entries()) == ids + [new]
        assert "invalid" in ws.stats()["limits"] and "stored limits are invalid" in caplog.text
        with pytest.raises(ValueError, match="stored limits are invalid"):
            ws.prune()  # the stored limits are needed and refused: nothing evicted
        ws.set_limits(max_entries=2)
        assert len(ws.prune()) == 3


def _cli(capsys, *args):
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prune_refuses_bad_limits_and_asks_before_keeping_nothing(tmp_path, capsys):
    root = tmp_path / "root"
    ids = _filled(root / "proj")
    before = tree_snapshot(root)
    common = ["--workspace", "proj", "--root", str(root)]
    for flag in ("--max-entries", "--max-bytes"):
        for value in ("-1", "nan", "inf", "1.5", str(2**70), "lots"):
            code, _, err = _cli(capsys, "prune", *common, flag, value)
            assert code == 2 and err.startswith("error: ") and flag in err, err
        code, _, err = _cli(capsys, "prune", *common, flag, "0")
        assert code == 2 and "--delete-all" in err and "nothing was deleted" in err, err
    code, _, err = _cli(capsys, "list", *common, "--limit", "-1")
    assert code == 2 and "--limit" in err
    assert tree_snapshot(root) == before, "a refused command changed the workspace"
    code, out, err = _cli(capsys, "prune", *common, "--max-entries", "0", "--delete-all", "--json")
    assert code == 0 and sorted(__import__("json").loads(out)["removed"]) == ids, err


def test_maintenance_node_refuses_bad_limits_before_opening_anything(tmp_path, monkeypatch):
    """Chorus Cache Maintenance with a linked INT that ComfyUI did not range-check (negative, NaN,
    inf, huge, a string, None): the report says why and nothing is deleted or created."""
    from host import tiny_wan as tiny

    reason = tiny.import_comfy()
    if reason is not None:
        pytest.skip(f"ComfyUI not available: {reason}")
    from chorus.nodes.cache_maintenance import ChorusCacheMaintenance

    root = tmp_path / "root"
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(root))
    monkeypatch.delenv("CHORUS_CACHE_URL", raising=False)
    ids = _filled(root / "proj")
    before = tree_snapshot(tmp_path)
    for bad in BAD_LIMITS:
        for workspace in ("proj", "not_created"):
            report = ChorusCacheMaintenance.execute(workspace=workspace, action="prune", max_entries=bad).result[0]
            assert report.startswith(f"prune {workspace} failed: ValueError") and "max_entries" in report, report
    for action in (None, 3, ["prune"], "drop"):
        report = ChorusCacheMaintenance.execute(workspace="not_created", action=action, max_entries=1).result[0]
        assert "failed: ValueError: unknown action" in report, report
    assert tree_snapshot(tmp_path) == before, "a refused maintenance call changed the cache"
    report = ChorusCacheMaintenance.execute(workspace="proj", action="prune", max_entries=3.0).result[0]
    assert '"entries": 3' in report, report  # an integral float from a linked node is the int it is
    with Workspace.open(root / "proj") as ws:
        assert sorted(e["id"] for e in ws.entries()) == ids[1:]
