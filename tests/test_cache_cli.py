"""The cache command line, run as users run it: ``python -m chorus cache ...`` in a subprocess."""

import json
import subprocess
import sys

from cache_helpers import SIGNATURE, embedding, small_masks, tree_snapshot
from chorus.cache_store import Workspace


def _cli(*args, root):
    return subprocess.run([sys.executable, "-m", "chorus", "cache", *args, "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


def test_cli_commands(tmp_path):
    root = tmp_path / "root"
    with Workspace.open(root / "proj") as ws:
        ids = [ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE, "prompt": f"prompt {s}"}) for s in range(6)]
        victim_file = ws.entry_path(ids[1])
        ws.touch(ids[5], run={"sparse_calls": 8, "tail_calls": 4, "fallback_calls": 2})

    out = _cli("stats", "--workspace", "proj", "--json", root=root)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["entries"] == 6 and stats["indexed"] == 6

    out = _cli("stats", "--path", str(root / "proj"), "--json", root=root)  # a directory instead of a name
    assert out.returncode == 0 and json.loads(out.stdout)["entries"] == 6, out.stderr

    out = _cli("list", "--workspace", "proj", root=root)
    assert out.returncode == 0 and "prompt 5" in out.stdout and len(out.stdout.strip().splitlines()) == 7
    # the touched entry's line: 1 hit, half its sparse calls with the pooled tail, 2 dense fallbacks
    assert [line.split()[4:7] for line in out.stdout.splitlines() if "prompt 5" in line] == [["1", "50%", "2"]], out.stdout

    out = _cli("verify", "--workspace", "proj", root=root)
    assert out.returncode == 0 and "no damage" in out.stdout, out.stdout + out.stderr
    assert "verify" in out.stderr  # the tqdm progress bar

    data = bytearray(victim_file.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim_file.write_bytes(bytes(data))
    before = tree_snapshot(root)
    out = _cli("verify", "--workspace", "proj", root=root)  # read-only: reports, quarantines nothing
    assert out.returncode == 1 and f"entry {ids[1]}" in out.stdout and "verify --repair" in out.stdout, out.stdout
    assert tree_snapshot(root) == before
    out = _cli("verify", "--repair", "--workspace", "proj", root=root)
    assert out.returncode == 1 and f"entry {ids[1]}" in out.stdout and "(quarantined)" in out.stdout, out.stdout
    assert _cli("verify", "--workspace", "proj", root=root).returncode == 0  # quarantined: clean again

    for f in (root / "proj").glob("index.g*.safetensors"):
        f.unlink()
    out = _cli("rebuild-index", "--workspace", "proj", "--json", root=root)
    assert out.returncode == 0 and json.loads(out.stdout)["entries"] == 5 and "rebuild-index" in out.stderr

    out = _cli("prune", "--workspace", "proj", "--max-entries", "2", "--json", root=root)
    assert out.returncode == 0 and len(json.loads(out.stdout)["removed"]) == 3
    with Workspace.open(root / "proj") as ws:
        assert len(ws) == 2 and ws.verify()["ok"]


def test_no_cache_command_imports_torch(tmp_path):
    """``stats``, ``list``, ``prune``, ``rebuild-index`` and ``init`` read the store's tables and index only, and
    ``verify`` checks each entry's decoding on numpy arrays, so no command pays torch's import (~2 s of a ~2.8 s
    command before; an operator's script pays it per call)."""
    root = tmp_path / "root"
    with Workspace.open(root / "proj") as ws:
        for s in range(3):
            ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE, "prompt": f"prompt {s}"})
    probe = ("import sys\n"
             "from chorus.__main__ import main\n"
             "rc = main(sys.argv[1:])\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc, file=sys.stderr)\n")
    proj = ["--workspace", "proj"]
    for args in (["stats", *proj], ["list", *proj], ["rebuild-index", *proj], ["prune", "--max-entries", "2", *proj],
                 ["init", "--workspace", "new"], ["verify", *proj]):
        out = subprocess.run([sys.executable, "-c", probe, "cache", *args, "--root", str(root)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stderr.strip().splitlines()[-1] == "NO-TORCH 0", (args, out.stderr)


def test_cli_bad_arguments(tmp_path):
    root = tmp_path / "root"
    for args in (("stats", "--workspace", "../etc"), ("stats", "--workspace", "/abs"), ("verify", "--workspace", "missing"),
                 ("frobnicate",), ("stats", "--bogus"), ("stats", "--path", str(tmp_path / "nowhere"))):
        out = _cli(*args, root=root)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
    assert not (root / "missing").exists() and not (tmp_path / "etc").exists() and not (tmp_path / "nowhere").exists()


# -- issue 16 / 15.5: one-line errors with exit 2, read-only commands, the root used ------------------
import os  # noqa: E402
import signal  # noqa: E402

import pytest  # noqa: E402

from chorus.cache_store import cli  # noqa: E402


def _run_inprocess(capsys, *args):
    """cli.main in this process: an uncaught exception (a traceback for a user) fails the test."""
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error_line(err: str) -> str:
    """The one error line of stderr (tqdm progress bars of verify / rebuild-index aside)."""
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_read_only_commands_write_nothing_and_refuse_non_workspaces(tmp_path, capsys):
    root = tmp_path / "root"
    with Workspace.open(root / "proj") as ws:
        for s in range(3):
            ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE, "prompt": f"prompt {s}"})
    before = tree_snapshot(tmp_path)
    code, out, err = _run_inprocess(capsys, "stats", "--workspace", "proj", "--root", str(root))
    assert code == 0 and "entries: 3 (" in out, (out, err)
    code, out, err = _run_inprocess(capsys, "list", "--workspace", "proj", "--root", str(root))
    assert code == 0 and all(sum(f"prompt {s}" in line for line in out.splitlines()) == 1 for s in range(3)), (out, err)
    assert tree_snapshot(tmp_path) == before, "a read-only command changed the workspace"

    folder = tmp_path / "etc_like"
    folder.mkdir()
    (folder / "hosts").write_text("127.0.0.1 localhost\n")
    before = tree_snapshot(folder)
    for action in ("stats", "list", "verify", "prune", "rebuild-index"):
        code, _, err = _run_inprocess(capsys, action, "--path", str(folder))
        assert code == 2 and "is not a Chorus cache workspace" in _one_error_line(err), err
    assert tree_snapshot(folder) == before, "a command created files in a folder that is not a workspace"


def test_list_shows_rows_edited_by_hand_and_prompts_as_plain_text(tmp_path, capsys):
    """A run counter edited to text (SQLite keeps it) lists as 0, in the text table and in --json: it never
    stops the listing (rule 4). Stored prompts are shown, never interpreted by the terminal."""
    import json
    import sqlite3

    path = tmp_path / "ws"
    with Workspace.open(path) as ws:
        ids = [ws.add(embedding(s), small_masks(s), {"signature": SIGNATURE, "prompt": f"prompt {s}"}) for s in range(2)]
        ws.touch(ids[1], run={"sparse_calls": 4, "tail_calls": 4})
    with sqlite3.connect(path / "chorus.sqlite3") as db:
        db.execute("UPDATE entries SET sparse_calls = 'y' WHERE id = ?", (ids[0],))
    code, out, err = _run_inprocess(capsys, "list", "--path", str(path))
    assert code == 0 and "prompt 0" in out and "100%" in out, (out, err)
    with Workspace.open(path) as ws:  # a prompt holding terminal escapes prints them as "?", not as escapes
        ws.add(embedding(7), small_masks(7), {"signature": SIGNATURE, "prompt": "red\x1b[31m\rfox\nnext"})
    code, out, err = _run_inprocess(capsys, "list", "--path", str(path))
    assert code == 0 and "red?[31m?fox?next" in out and "\x1b" not in out and "\r" not in out, (out, err)
    code, out, err = _run_inprocess(capsys, "list", "--path", str(path), "--json")
    listed = json.loads(out)
    assert code == 0 and len(listed) == 3 and listed[0]["runs"]["sparse_calls"] == 0, (out, err)


@pytest.mark.parametrize("damage", ["db_directory", "db_garbage", "entries_link", "long_root", "bad_comfyui",
                                    "name_is_a_path", "relative_env_root"])
def test_errors_are_one_line_with_exit_2(tmp_path, capsys, monkeypatch, damage):
    root = tmp_path / "root"
    Workspace.open(root / "proj").close()
    ws_dir = root / "proj"
    args = ["verify", "--workspace", "proj", "--root", str(root)]
    expect = str(root)  # every error names the root it used
    if damage == "db_directory":
        (ws_dir / "chorus.sqlite3").unlink()
        (ws_dir / "chorus.sqlite3").mkdir()
    elif damage == "db_garbage":
        (ws_dir / "chorus.sqlite3").write_bytes(b"not sqlite" * 1000)
    elif damage == "entries_link":
        (ws_dir / "entries").rmdir()
        (ws_dir / "entries").symlink_to(tmp_path)
    elif damage == "long_root":
        args, expect = ["stats", "--root", str(tmp_path / ("x" * 300))], "too long"
    elif damage == "bad_comfyui":
        args, expect = ["stats", "--comfyui", str(tmp_path / "no_comfy")], "--comfyui"
    elif damage == "name_is_a_path":
        args, expect = ["stats", "--workspace", str(ws_dir), "--root", str(root)], "use --path"
    else:
        monkeypatch.setenv("CHORUS_CACHE_DIR", "relative/dir")
        args, expect = ["stats"], "relative path"
    code, _, err = _run_inprocess(capsys, *args)
    assert code == 2 and expect in _one_error_line(err), err


def test_busy_store_and_file_size_limit_are_errors_not_tracebacks(tmp_path):
    """As users run it (a subprocess): a writer holding the store past --timeout, and a real OSError
    in the middle of a write (EFBIG from a file-size limit while rebuild-index saves the index), each
    give one error line and exit 2; stats still works beside the busy writer (it takes no lock)."""
    import resource

    from cache_helpers import Holder

    root = tmp_path / "root"
    with Workspace.open(root / "proj") as ws:
        for s in range(40):  # 1024-dim embeddings: the saved index takes ~170 KB
            ws.add(embedding(s, dim=1024), small_masks(s, layers=1), {"signature": SIGNATURE})
    holder = Holder(root / "proj")
    try:
        out = _cli("prune", "--workspace", "proj", "--max-entries", "1", "--timeout", "1", root=root)
        assert out.returncode == 2 and "writers' lock" in _one_error_line(out.stderr), out.stderr
        out = _cli("stats", "--workspace", "proj", "--json", root=root)
        assert out.returncode == 0 and json.loads(out.stdout)["entries"] == 40, out.stderr
    finally:
        holder.release()

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # SQLite's files fit, the index does not

    out = subprocess.run([sys.executable, "-m", "chorus", "cache", "rebuild-index", "--workspace", "proj",
                          "--root", str(root)], capture_output=True, text=True, timeout=120,
                         preexec_fn=limit_file_size)
    assert out.returncode == 2 and "File too large" in _one_error_line(out.stderr), out.stderr
    with Workspace.open(root / "proj") as ws:
        assert len(ws) == 40 and ws.verify()["ok"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: a permission error cannot happen")
def test_permission_error_is_one_line(tmp_path, capsys):
    root = tmp_path / "root"
    Workspace.open(root / "proj").close()
    (root / "proj" / "chorus.sqlite3").chmod(0)
    try:
        code, _, err = _run_inprocess(capsys, "stats", "--workspace", "proj", "--root", str(root))
        assert code == 2 and _one_error_line(err)
    finally:
        (root / "proj" / "chorus.sqlite3").chmod(0o644)


def test_comfyui_option_and_help_name_the_root(tmp_path, capsys, monkeypatch):
    comfy = tmp_path / "ComfyUI"
    with Workspace.open(comfy / "user" / "chorus" / "proj") as ws:
        ws.add(embedding(0), small_masks(0), {"signature": SIGNATURE})
    code, out, err = _run_inprocess(capsys, "stats", "--comfyui", str(comfy), "--workspace", "proj", "--json")
    assert code == 0 and json.loads(out)["entries"] == 1, err
    code, _, err = _run_inprocess(capsys, "verify", "--comfyui", str(comfy), "--workspace", "nope")
    assert code == 2 and f"{comfy / 'user' / 'chorus'} (--comfyui)" in _one_error_line(err)

    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "env_root"))
    code, _, err = _run_inprocess(capsys, "stats", "--workspace", "nope")
    assert code == 2 and f"{tmp_path / 'env_root'} (CHORUS_CACHE_DIR)" in _one_error_line(err)
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping (argparse breaks long paths at their hyphens)
    with pytest.raises(SystemExit) as helped:
        cli._parser().parse_args(["stats", "--help"])
    assert helped.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--comfyui DIR (= DIR/user/chorus" in text and f"now: {tmp_path / 'env_root'} (CHORUS_CACHE_DIR)" in text
    assert "`chorus` command" in text

    top = subprocess.run([sys.executable, "-m", "chorus", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "cache   inspect and maintain" in top.stdout and "`chorus` command" in top.stdout


def test_argument_errors_are_one_line(capsys):
    for args in (["stats", "--bogus"], [], ["frobnicate"], ["prune", "--max-entries", "x"], ["init", "--path", ""],
                 ["prune", "--path", "", "--max-entries", "1"], ["stats", "--root", ""]):
        code, _, err = _run_inprocess(capsys, *args)
        assert code == 2 and _one_error_line(err), (args, err)
    from chorus.__main__ import main as top

    for args in ([], ["frobnicate"]):
        assert top(args) == 2
        _one_error_line(capsys.readouterr().err)
