"""Per-call self-attention time inside the benchmark of record, by CUDA events (no host sync is added).

- :class:`AttentionTimer` / :func:`with_timer`: an outermost attention override on an eager model (every
  self-attention call of the high-noise expert, or the one model).
- :class:`OpTimer`: the work of every ``torch.ops.chorus.attend`` call of a compiled Chorus request (an override
  would be traced into the graph; the op's work runs eagerly inside it).

Tests: ``tests/test_comfy_e2e_bench.py`` (the CPU path; the events themselves need CUDA).
"""

from __future__ import annotations

import torch


class AttentionTimer:
    """Outermost attention override: CUDA events around every self-attention call (k length == q
    length) of the model it is installed on; everything else passes straight to the inner override.
    Nothing here reads a device value, so the timer adds no host sync to the run it measures."""

    def __init__(self, inner):
        self.inner = inner
        self.events: list = []

    @property
    def previous_override(self):
        """The override it chains: the Chorus nodes see through the timer (``nodes/override_stack.py``)."""
        return self.inner

    def __deepcopy__(self, memo):
        return self

    def _inner(self, func, args, kwargs):
        return self.inner(func, *args, **kwargs) if self.inner is not None else func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        q, k = args[0], args[1]
        if q.shape[1] != k.shape[1] or not q.is_cuda:
            return self._inner(func, args, kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self._inner(func, args, kwargs)
        end.record()
        self.events.append((start, end))
        return out

    def per_call_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self.events]


class OpTimer:
    """CUDA events around the work of every ``torch.ops.chorus.attend`` call of the request it is
    active for (``ForwardContext.self_attention`` runs eagerly inside a compiled graph), the high
    expert's calls only when ``experts`` says so. No host sync is added."""

    def __init__(self):
        self.events: list = []
        self._real = None

    def __enter__(self):
        from chorus.engine.attend import ForwardContext

        real = self._real = ForwardContext.self_attention
        timer = self

        def timed(context, q, *args, **kwargs):
            if not q.is_cuda or context.attention is None or context.attention.expert != 0:
                return real(context, q, *args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = real(context, q, *args, **kwargs)
            end.record()
            timer.events.append((start, end))
            return out

        ForwardContext.self_attention = timed
        return self

    def __exit__(self, *exc):
        from chorus.engine.attend import ForwardContext

        ForwardContext.self_attention = self._real

    def per_call_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self.events]


def with_timer(models):
    """``models`` with an :class:`AttentionTimer` outermost on a clone of the first (the high-noise expert, or
    the one model), and that timer."""
    first = models[0].clone()
    opts = first.model_options.setdefault("transformer_options", {})
    timer = AttentionTimer(opts.get("optimized_attention_override"))
    opts["optimized_attention_override"] = timer
    return (first, *models[1:]), timer
