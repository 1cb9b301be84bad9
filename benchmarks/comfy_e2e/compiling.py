"""``TorchCompileModel`` as the benchmark of record runs it, and what compiling cost a row.

- :func:`torch_compile_model`: a model through the host's own ``TorchCompileModel`` node (inductor), optionally
  with later ComfyUI's guard filter on a host whose node has none (:func:`drop_transformer_options_guards`,
  :func:`host_compiles_with_guard_filter`).
- :class:`CompileLog`: a compiled row's first request, split by who compiled (dynamo, the backend, each Triton
  build with its specialisation): the row's ``first_request_compile``.
- :func:`compiled_frames` / :data:`STEADY_RETRIES`: dynamo's frame compiles so far, by which a compiled row
  finds a request that compiled nothing to time.
- :class:`RecompileLog`: each recompile's guard failure while a row runs (``dynamo.recompile_reasons``).

Tests: ``tests/test_comfy_e2e_bench.py``.
"""

from __future__ import annotations

import logging
import os

import torch


def drop_transformer_options_guards(guard_entries) -> list[bool]:
    """ComfyUI's ``TorchCompileModel`` guard filter after 0.3.64 (0.38.x: its ``mode`` left empty): keep a dynamo
    guard unless its name mentions ``transformer_options``."""
    return ["transformer_options" not in entry.name for entry in guard_entries]


def host_compiles_with_guard_filter(compiled) -> bool:
    """Whether the host's ``TorchCompileModel`` compiled ``compiled`` (its output) with compile options, which
    every ComfyUI that has them uses for its guard filter (no dynamo guard on ``transformer_options``): 0.3.64
    passes none; 0.28.2 and 0.33.0 always pass the filter (run), as the newest stored versions of the node do (read)."""
    return compiled.model_options.get("torch_compile_kwargs", {}).get("options") is not None


def torch_compile_model(model, guard_filter: bool = False):
    """``model`` through the host's own ``TorchCompileModel`` node (inductor) as a user's graph runs it: in
    0.3.64 ``execute(model, backend)``, as in every version stored on 2026-12-07; a node that also takes a
    ``mode`` (read in 2026-12-05's store) gets it left empty, the node's default. ``guard_filter``
    on a host whose node compiles without options (0.3.64): compile as later ComfyUI's node does, through the
    host's own ``set_torch_compile_wrapper`` with :func:`drop_transformer_options_guards`."""
    import inspect

    from comfy_extras.nodes_torch_compile import TorchCompileModel

    if "mode" in inspect.signature(TorchCompileModel.execute).parameters:
        compiled = TorchCompileModel.execute(model, "inductor", "").result[0]
    else:
        compiled = TorchCompileModel.execute(model, "inductor").result[0]
    if not guard_filter or host_compiles_with_guard_filter(compiled):
        return compiled
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    compiled = model.clone()
    set_torch_compile_wrapper(model=compiled, backend="inductor",
                              options={"guard_filter_fn": drop_transformer_options_guards})
    return compiled


class CompileLog:
    """What one compiled first request spent compiling, by who compiled: dynamo's frame compiles
    (``torch._dynamo.utils.compilation_time_metrics``: ``_compile.compile_inner``, of which the backend -- AOT
    autograd and inductor -- ``OutputGraph.call_user_compiler``) and every Triton build in this process, through
    ``triton.knobs.compilation.listener`` (Chorus's kernels, built at their first launch; inductor builds its own
    kernels in worker processes, inside its time). :meth:`summary` is the row's ``first_request_compile``; its Triton
    fields are None where this Triton has no listener. Builds are counted apart from Triton's on-disk cache hits:
    run with empty ``TRITON_CACHE_DIR`` / ``TORCHINDUCTOR_CACHE_DIR`` for a first request on a fresh machine.
    ``triton_builds_detail``: each build or cache hit in order, with the specialisation it was built for (argument
    types, the constants -- constexprs and arguments Triton specialised to a value -- and the divisibility attributes
    it derived from the launch), so two builds of one kernel say what differed between their launches."""

    def __init__(self):
        self.builds: list[dict] = []  # each build or disk-cache hit, in order (``triton_builds_detail``)
        self._knobs = self._prev = None
        self._before = self._after = {}

    @staticmethod
    def _metric_sums() -> dict:
        from torch._dynamo.utils import compilation_time_metrics

        return {name: float(sum(times)) for name, times in compilation_time_metrics.items()}

    def __enter__(self):
        try:
            from triton import knobs
        except ImportError:
            knobs = None
        if knobs is not None and hasattr(getattr(knobs, "compilation", None), "listener"):
            self._knobs, self._prev = knobs, knobs.compilation.listener
            knobs.compilation.listener = self._on_build
        self._before = self._metric_sums()
        return self

    def _on_build(self, **event):
        """Triton's listener call (keywords ``src``, ``metadata``, ``metadata_group``, ``times``, ``cache_hit``):
        passed on to a listener installed before, then recorded. It runs inside Triton's compile, so it never
        raises: an event it cannot read is recorded as such (``error``) and the build goes on."""
        if self._prev is not None:
            self._prev(**event)
        try:
            self.builds.append(self._build_record(**event))
        except Exception as exc:  # noqa: BLE001 - a measuring hook must not fail the kernel build it watches
            self.builds.append({"kernel": "?", "s": 0.0, "cache_hit": bool(event.get("cache_hit")),
                                "error": f"{type(exc).__name__}: {exc}"[:200]})

    @staticmethod
    def _build_record(*, src, metadata, times, cache_hit, **_) -> dict:
        name = getattr(getattr(src, "fn", None), "__name__", None) or str(metadata.get("name", "?"))
        signature = getattr(src, "signature", None) or {}
        names = list(signature)

        def by_name(table):  # Triton keys constants and attributes by argument path: (index,) for a plain argument
            return {(names[k[0]] if isinstance(k, tuple) and len(k) == 1 and k[0] < len(names) else str(k)): repr(v)
                    for k, v in (table or {}).items()}

        return {"kernel": name, "s": times.total / 1e6, "cache_hit": bool(cache_hit),  # CompileTimes: microseconds
                "signature": {str(k): str(v) for k, v in signature.items() if v != "constexpr"},
                "constants": by_name(getattr(src, "constants", None)), "attrs": by_name(getattr(src, "attrs", None))}

    def __exit__(self, *exc):
        if self._knobs is not None:
            self._knobs.compilation.listener = self._prev
        self._after = self._metric_sums()

    def summary(self) -> dict:
        def spent(name):  # (a torch._dynamo.reset() inside the window clears the metrics: what came after it counts)
            before, after = self._before.get(name, 0.0), self._after.get(name, 0.0)
            return round(after - before if after >= before else after, 3)

        built = [b for b in self.builds if not b["cache_hit"]]
        by_kernel: dict[str, float] = {}
        for b in built:
            by_kernel[b["kernel"]] = round(by_kernel.get(b["kernel"], 0.0) + b["s"], 3)
        listening = self._knobs is not None
        return {"dynamo_s": spent("_compile.compile_inner"), "backend_s": spent("OutputGraph.call_user_compiler"),
                "triton_builds": len(built) if listening else None,
                "triton_build_s": round(sum(b["s"] for b in built), 3) if listening else None,
                "triton_cache_hits": len(self.builds) - len(built) if listening else None,
                "triton_build_s_by_kernel": by_kernel if listening else None,
                "triton_builds_detail": [dict(b, s=round(b["s"], 3)) for b in self.builds] if listening else None}


STEADY_RETRIES = 2  # further requests a compiled row may run until one compiles nothing (its timed request)


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process so far (first compiles and recompiles; ``torch._dynamo``'s
    counters, cleared with them)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"].get("total", 0))


class RecompileLog(logging.Handler):
    """Dynamo's recompile reasons while a compiled row runs (its ``dynamo.recompile_reasons``): each recompile's
    message ("Recompiling function ... triggered by the following guard failure(s): ..."), from the
    ``recompiles`` log artifact, which this turns on for its window (torch's own handler prints them too) unless
    ``TORCH_LOGS`` is set, whose settings then decide what is logged."""

    LOGGER = "torch._dynamo.guards.__recompiles"

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []
        self._own_settings = False

    def emit(self, record):
        self.reasons.append(record.getMessage())

    def __enter__(self):
        self._own_settings = "TORCH_LOGS" not in os.environ
        if self._own_settings:
            torch._logging.set_logs(recompiles=True)
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self)
        if self._own_settings:
            torch._logging.set_logs()

    def summary(self, first: int = 4) -> list[str]:
        """The first ``first`` reasons, each as its function's line and first guard failure (300 characters)."""
        return [" / ".join(line.strip() for line in r.splitlines() if line.strip() and "triggered by" not in line)[:300]
                for r in self.reasons[:first]]


def dynamo_summary(recompiles: RecompileLog) -> dict:
    """A compiled row's ``dynamo``: from ``torch._dynamo``'s counters (since they were last cleared) the unique
    graphs, the graph breaks (count, and up to 8 distinct first lines of their reasons), the frames compiled by
    outcome (every compile, recompiles too), and from ``recompiles`` each recompile (count, the first four
    reasons)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "frames": {k: int(v) for k, v in counters["frames"].items()},
            "graph_break_reasons": sorted({r.splitlines()[0][:160] for r in counters["graph_break"]})[:8],
            "recompiles": len(recompiles.reasons), "recompile_reasons": recompiles.summary()}
