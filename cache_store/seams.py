"""Test seams: the named points of the stores' write protocols where a test may fail or kill the process.

:func:`workspace_phase` is called by the one-host workspace at ``"temp_written"`` and ``"renamed"``
(its atomic writes), ``"file_durable"``, ``"before_commit"``, ``"committed"`` (an add),
``"row_read"`` (a load, between reading the row and the file) and ``"verify_listed"`` (verify,
after listing the entries); :func:`fleet_phase` by the fleet store at ``"before_commit"`` (inside
the write transaction) and ``"committed"``. Both do nothing in production; a test replaces one
(``monkeypatch.setattr(seams, "workspace_phase", hook)``). The stores look them up at each call.
"""


def workspace_phase(phase: str) -> None:
    """Called at each named point of the workspace's protocols (no-op)."""


def fleet_phase(phase: str) -> None:
    """Called at each named point of the fleet store's write protocol (no-op)."""
