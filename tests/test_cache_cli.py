"""The cache command line, run as users run it: ``python -m chorus cache ...`` in a subprocess."""

import json
import subprocess
import sys

from cache_helpers import SIGNATURE, embedding, small_masks
from chorus.cache_store import Workspace


def _cli(*args, root):
    return subprocess.run([sys.executable, "-m", "chorus", "cache", *args, "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


def test_cli_commands(tmp_path):
    root = tmp_path / "root"
    with Workspace.open(root / "proj") as ws:
        ids = [ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE, "prompt": f"prompt {s}"}) for s in range(6)]
        victim_file = root / "proj" / "entries" / ws._row(ids[1])[0]

    out = _cli("stats", "--workspace", "proj", "--json", root=root)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["entries"] == 6 and stats["indexed"] == 6

    out = _cli("stats", "--path", str(root / "proj"), "--json", root=root)  # a directory instead of a name
    assert out.returncode == 0 and json.loads(out.stdout)["entries"] == 6, out.stderr

    out = _cli("list", "--workspace", "proj", root=root)
    assert out.returncode == 0 and "prompt 5" in out.stdout and len(out.stdout.strip().splitlines()) == 7

    out = _cli("verify", "--workspace", "proj", root=root)
    assert out.returncode == 0 and "no damage" in out.stdout, out.stdout + out.stderr
    assert "verify" in out.stderr  # the tqdm progress bar

    data = bytearray(victim_file.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim_file.write_bytes(bytes(data))
    out = _cli("verify", "--workspace", "proj", root=root)
    assert out.returncode == 1 and f"entry {ids[1]}" in out.stdout, out.stdout + out.stderr
    assert _cli("verify", "--workspace", "proj", root=root).returncode == 0  # quarantined: clean again

    for f in (root / "proj").glob("index.g*.safetensors"):
        f.unlink()
    out = _cli("rebuild-index", "--workspace", "proj", "--json", root=root)
    assert out.returncode == 0 and json.loads(out.stdout)["entries"] == 5 and "rebuild-index" in out.stderr

    out = _cli("prune", "--workspace", "proj", "--max-entries", "2", "--json", root=root)
    assert out.returncode == 0 and len(json.loads(out.stdout)["removed"]) == 3
    with Workspace.open(root / "proj") as ws:
        assert len(ws) == 2 and ws.verify()["ok"]


def test_cli_bad_arguments(tmp_path):
    root = tmp_path / "root"
    for args in (("stats", "--workspace", "../etc"), ("stats", "--workspace", "/abs"), ("verify", "--workspace", "missing"),
                 ("frobnicate",), ("stats", "--bogus"), ("stats", "--path", str(tmp_path / "nowhere"))):
        out = _cli(*args, root=root)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
    assert not (root / "missing").exists() and not (tmp_path / "etc").exists() and not (tmp_path / "nowhere").exists()
