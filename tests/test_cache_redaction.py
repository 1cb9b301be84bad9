"""No command line, log line, exception or UI text holds a password (``cache_store/redaction.py``):
every way a URL can be mistyped on the command line (argparse echoes what it refuses), unknown
commands, the demo's own parser, logs of the stores, node UI text."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import chorus.__main__ as chorus_main
from chorus.cache_store import redaction
from chorus.cache_store.redaction import RedactingFilter, redact, url_passwords

SECRET = "S3cr3t-pw"
URL = f"postgresql://chorus_worker:{SECRET}@127.0.0.1:1/chorus"

# each way an operator may mistype a command holding the URL: (argv, why it is refused)
MISTYPED = [
    (["cache", "stats", URL], "a URL where no positional argument goes"),
    (["cache", URL, "stats"], "a URL where the command goes"),
    (["cache", "stats", "--urll", URL], "a misspelt option"),
    (["cache", "--url", URL, "stats"], "the option before the command"),
    ([URL], "a URL where the command goes (python -m chorus <url>)"),
    (["cach", "stats", "--url", URL], "a misspelt command"),
    (["cache", "stat", "--url", URL], "a misspelt subcommand"),
    (["cache", "stats", "--timeout", URL], "a URL as another option's value"),
    (["cache", "prune", "--max-entries", URL], "a URL as a limit"),
    (["cache", "stats", "--workspace", URL], "a URL as the workspace name"),
    (["cache", "stats", "--root", URL], "a URL as the root"),
    (["cache", "stats", "--path", URL], "a URL as the workspace directory"),
    (["cache", "stats", "--url", URL.replace("postgresql://", "postgresq://")], "a misspelt scheme"),
    (["cache", "stats", "--url", URL.replace("postgresql://", "")], "no scheme"),
    (["cache", "stats", "--url", URL.replace(":1/", ":port/")], "a URL that does not parse"),
    (["cache", "stats", "--url", URL.replace(SECRET, SECRET + "@x")], "a password holding @, unencoded"),
    (["cache", "stats", "--url", f"host=127.0.0.1 port=1 password={SECRET}"], "a key=value connection string"),
    (["cache", "stats", "--url", URL + f"?password={SECRET}"], "a password in the query"),
    (["cache", "stats", "--url", URL, "--workspace", "w", "--root", "/nonexistent/root"], "unreachable, valid URL"),
]


def test_redact_removes_passwords_of_every_shape():
    cases = {
        URL: "postgresql://chorus_worker:***@127.0.0.1:1/chorus",
        f"'postgres://u:{SECRET}@h/db'": "'postgres://u:***@h/db'",
        f"u:{SECRET}@h:5432/db": "u:***@h:5432/db",
        f"postgresql:/u:{SECRET}@h/db": None,  # a path-normalised URL: the secret goes, whatever the rest
        f"postgresql://u:p@{SECRET}@h/db": "postgresql://u:***@h/db",
        f"host=h password={SECRET} user=u": "host=h password=*** user=u",
        f"host=h password='{SECRET} x' user=u": "host=h password=*** user=u",
        f"PGPASSWORD={SECRET}": "PGPASSWORD=***",
        "mail me at someone@example.com, 12:30": "mail me at someone@example.com, 12:30",
        "postgresql://chorus_worker@db.internal/chorus": "postgresql://chorus_worker@db.internal/chorus",
    }
    for text, expected in cases.items():
        got = redact(text)
        assert SECRET not in got, (text, got)
        if expected is not None:
            assert got == expected, (text, got)
    assert redact("the password is hunter2", secrets=["hunter2"]) == "the password is ***"
    assert url_passwords(["stats", URL, f"password={SECRET}"]) == [SECRET, SECRET]


@pytest.mark.parametrize("argv,why", MISTYPED, ids=[why for _, why in MISTYPED])
def test_no_mistyped_command_line_shows_the_password(argv, why, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)  # a URL taken for a relative path lands here, if anywhere
    code = chorus_main.main(argv)
    out = capsys.readouterr()
    shown = out.out + out.err
    assert code == 2 and SECRET not in shown, (why, shown)
    errors = [line for line in out.err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "Traceback" not in shown, (why, out.err)
    assert list(tmp_path.iterdir()) == [], "a refused command created something"


def test_real_stderr_of_mistyped_commands_and_the_demo_parser(tmp_path):
    """As users run it (subprocesses): argparse writes straight to the process's stderr."""
    for argv in (["cache", URL, "stats"], [URL], ["demo", "--nonsense", URL]):
        done = subprocess.run([sys.executable, "-m", "chorus", *argv], capture_output=True, text=True, timeout=300,
                              cwd=str(tmp_path))
        assert done.returncode == 2 and SECRET not in done.stdout + done.stderr, (argv, done.stderr)
        assert "***" in done.stderr, done.stderr  # the URL is named, its password is not


def test_logs_of_the_stores_and_nodes_are_redacted(caplog, monkeypatch):
    from chorus.cache_store import fleet

    monkeypatch.setenv("PGPASSWORD", "env-" + SECRET)
    caplog.set_level(logging.DEBUG)
    fleet.LOG.warning("could not reach %s (%s)", URL, "env-" + SECRET)
    logging.getLogger("chorus.cache_store.fleet").error(f"password={SECRET}")
    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET not in logs and "chorus_worker:***@" in logs, logs
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", (URL,), None)
    assert RedactingFilter().filter(record) and SECRET not in record.getMessage()


def test_redacting_stderr_wraps_and_restores():
    before = sys.stderr
    with redaction.redacting_stderr([URL]):
        assert sys.stderr is not before and hasattr(sys.stderr, "fileno")
    assert sys.stderr is before


def test_node_ui_text_never_shows_the_password(tmp_path, monkeypatch):
    """A fleet URL with a password that cannot be reached: Chorus Mask Retrieve misses with the
    reason, Chorus Cache Maintenance reports the failure; neither shows the password."""
    from host import tiny_wan as tiny

    reason = tiny.import_comfy()
    if reason is not None:
        pytest.skip(f"ComfyUI not available: {reason}")
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    import torch

    from chorus.nodes.cache_maintenance import ChorusCacheMaintenance
    from chorus.nodes.common import ui_text
    from chorus.nodes.mask_retrieve import ChorusMaskRetrieve

    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("CHORUS_CACHE_URL", URL)
    out = ChorusMaskRetrieve.execute(latent={"samples": torch.zeros(1, 16, 2, 4, 4)}, workspace="w",
                                     positive=tiny.random_conditioning(1))
    report = ChorusCacheMaintenance.execute(workspace="w", action="stats").result[0]
    shown = " ".join(out.ui["text"]) + out.result[2] + report + str(ui_text(f"x {URL}"))
    assert "unusable" in out.result[2] and "failed" in report, shown
    assert SECRET not in shown, shown
