"""Credentials never reach a terminal, a log or a UI: the one place that redacts them.

:func:`redact` is applied to every text the stores, the command line (its own messages and
argparse's, which echo mistyped arguments), ``python -m chorus`` (unknown commands) and the nodes'
UI text print or log. It removes:

* the password of any URL, mistyped or not: in every run of non-blank, non-quote characters that
  holds an ``@``, whatever lies between the first ``:`` of its user information and its last
  ``@`` becomes ``***`` (``postgresql://u:pw@h`` -> ``postgresql://u:***@h``; also without a
  scheme, ``u:pw@h``, with a mistyped scheme, or a password that itself holds ``@``); the
  user name stays, as libpq shows it;
* ``password=...`` in connection strings and URL queries (``password=***``);
* the literal value of every secret passed in and of ``PGPASSWORD`` (at least 4 characters long:
  a shorter one would blank out ordinary words).

:class:`RedactingFilter` applies it to log records; :func:`redacting_stderr` to everything a
command writes to stderr; :func:`url_passwords` finds the passwords typed in a command line so
that they are redacted wherever they reappear. Tested in ``tests/test_cache_redaction.py`` (every
way a URL can be mistyped on the command line; logs; node UI text).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys

_TOKEN = re.compile(r"[^\s'\"<>`]+@[^\s'\"<>`]*")
_PASSWORD_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&'\"]+)", re.IGNORECASE)
MIN_SECRET_CHARS = 4


def _userinfo(token: str) -> tuple[str, int, str, str]:
    """``(head, start, at, tail)`` of a ``user:password@host...`` token: ``head[start:]`` is its user
    info (``scheme://`` skipped), ``at + tail`` what follows it."""
    head, at, tail = token.rpartition("@")
    scheme_end = head.find("://")
    return head, scheme_end + 3 if scheme_end >= 0 else 0, at, tail


def _redact_token(match: re.Match) -> str:
    token = match.group(0)
    head, start, at, tail = _userinfo(token)
    userinfo = head[start:]
    if ":" not in userinfo:
        return token
    user = userinfo.split(":", 1)[0]
    return head[:start] + user + ":***" + at + tail


def redact(text, secrets=()) -> str:
    """``text`` (any object, as ``str``) without passwords (see the module docstring)."""
    text = _TOKEN.sub(_redact_token, str(text))
    text = _PASSWORD_KV.sub(r"\1***", text)
    for secret in (*secrets, os.environ.get("PGPASSWORD")):
        if secret and len(secret) >= MIN_SECRET_CHARS:
            text = text.replace(secret, "***")
    return text


def url_passwords(args) -> list[str]:
    """The passwords written into URLs or ``password=`` settings among ``args`` (a command line),
    so that :func:`redact` can also remove them where they reappear split or decoded."""
    found = []
    for arg in args:
        for match in _TOKEN.finditer(str(arg)):
            head, start, _, _ = _userinfo(match.group(0))
            userinfo = head[start:]
            if ":" in userinfo:
                found.append(userinfo.split(":", 1)[1])
        for match in _PASSWORD_KV.finditer(str(arg)):
            found.append(match.group(2).strip("'\""))
    return [secret for secret in found if secret]


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's message (with its arguments merged in)."""

    def __init__(self, secrets=()):
        super().__init__()
        self.secrets = list(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message, self.secrets)
        if cleaned != message or record.args:
            record.msg, record.args = cleaned, None
        return True


class _RedactingStream:
    def __init__(self, stream, secrets):
        self._stream, self._secrets = stream, secrets

    def write(self, text):
        return self._stream.write(redact(text, self._secrets))

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacting_stderr(argv=()):
    """Within the block, everything written to ``sys.stderr`` is redacted (with the passwords
    found in ``argv`` as secrets): argparse errors of every subcommand, tracebacks, progress."""
    original = sys.stderr
    sys.stderr = _RedactingStream(original, url_passwords(argv))
    try:
        yield
    finally:
        sys.stderr = original
