"""ChorusCacheMaintenance: stats / verify / prune / rebuild-index of a workspace, from the graph."""

from __future__ import annotations

import json

from comfy_api.latest import io

from ..cache_store.limits import limit_value
from ..engine.state import failure_text
from .common import CATEGORY, node_text, open_workspace, search_aliases, ui_text

ACTIONS = ("stats", "verify", "prune", "rebuild-index")


class ChorusCacheMaintenance(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ChorusCacheMaintenance",
            display_name="Chorus Cache Maintenance",
            category=CATEGORY,
            **search_aliases("attention mask cache stats", "prune the mask cache"),
            description="Cache workspace maintenance: statistics, checksum verification (damaged entries are "
                        "quarantined), pruning to a maximum number of entries, index rebuild.",
            inputs=[
                io.String.Input("workspace", default="default", tooltip="Cache workspace name."),
                io.Combo.Input("action", options=list(ACTIONS), default="stats",
                               tooltip="stats: counts and sizes; verify: check every entry; prune: evict down to "
                                       "max_entries (LRU); rebuild-index: rebuild the search index from the entries."),
                io.Int.Input("max_entries", default=0, min=0, max=10_000_000,
                             tooltip="For prune: keep at most this many entries (0 = the workspace's own limits)."),
            ],
            outputs=[io.String.Output("report", display_name="report")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")

    @classmethod
    def execute(cls, workspace="default", action="stats", max_entries=0) -> io.NodeOutput:
        """Run ``action``; any bad input (an unknown action, a ``max_entries`` that
        ``cache_store.limits`` refuses: negative, NaN, infinite, non-integral, absurd, not a number)
        is reported before the workspace is opened, so nothing is created or deleted."""
        try:
            if not isinstance(action, str) or action not in ACTIONS:
                raise ValueError(f"unknown action {action!r}; one of {ACTIONS}")
            keep = (limit_value(max_entries, "max_entries") or None) if action == "prune" else None
            ws = open_workspace(workspace, create=False)  # a mistyped name creates nothing (as the command line)
            if action == "stats":
                result = ws.stats()
            elif action == "verify":
                result = ws.verify()
            elif action == "prune":
                removed = ws.prune(max_entries=keep)
                result = {"removed": list(removed), "entries": len(ws)}
            else:  # the command line's result of the same action
                result = {"index": ws.rebuild_index(), "entries": len(ws)}
            report = f"{action} {workspace}: " + json.dumps(result, default=str, sort_keys=True)
        except Exception as exc:  # noqa: BLE001 - maintenance reports, never fails the prompt
            report = f"{action} {workspace} failed: {failure_text(exc)}"
        report = node_text(report)
        return io.NodeOutput(report, ui=ui_text(report))
