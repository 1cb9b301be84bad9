"""One self-attention call as a host hands it to the engine: :class:`AttnCall` (frozen).

A host translates its own arguments into an ``AttnCall`` and hands it to the engine's one entry,
:func:`chorus.engine.runtime.attend` (``ChorusAttention.attend``); the engine owns what happens to
it (bias, expand, sparse or dense + recording, verification, compact, counters and notes). This
module holds the call itself and the parts of that order that need nothing but the call: the
image biases on a dense call, the expansion of a compact call to its full grid and back, and
the checks that turn a call the engine cannot serve into a :class:`Fallback` (dense attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from ..kernels import pooling
from .guidance import biased_dense_or_plain, image_biased_attention
from .state import failure_text

__all__ = ["AttnCall", "Fallback", "sdpa"]


class Fallback(Exception):
    """A reason to run one call dense (not an error of the host)."""


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's dense attention on ``[B, H, L, D]``: the engine's dense call where the host gave none."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@dataclass(frozen=True, eq=False)
class AttnCall:
    """One self-attention call.

    - ``q, k, v``: ``[B, H, L, D]`` (post-norm, post-RoPE; any strides). ``L`` = the grid's tokens, or,
      with ``layout``, the compact sequence's ``layout.compact_length``.
    - ``layer``: block index of the model; ``sigma``: the forward's sigma (float or tensor, first
      element; None when the host had none: the call runs dense); ``grid``: token grid ``(T', H', W')``.
    - ``cond_rows``: bool ``[B]`` marking rows of positive conditioning (recorded on a miss), or None
      (all rows).
    - ``layout``: a feature-reuse block's :class:`~chorus.kernels.pooling.RegionLayout` when q/k/v are
      its compact sequence, else None.
    - ``first_frame_bias``: guidance's logit bias (natural-log units) for the first frame's
      ``H' * W'`` keys (0.0: none); applied in the sparse kernel and in every dense call of this call.
    - ``last_frame_bias``: the same for the last frame's keys (a first-last-frame request's end image;
      0.0: none): a full-grid call's suffix (:attr:`suffix_len`), a compact call's key prefix where its
      layout leads with the last frame (:attr:`key_prefix`); in every dense call, and in the sparse kernel
      where the run's token order ends with the last frame or the layout leads with it.
    - ``dense_fn(q, k, v) -> [B, H, L, D]``: the host's dense attention (None: PyTorch SDPA).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: int
    sigma: Any
    grid: tuple
    cond_rows: Any = None
    layout: Any = None
    first_frame_bias: float = 0.0
    dense_fn: Callable | None = None
    last_frame_bias: float = 0.0

    @property
    def key_prefix(self) -> tuple[int, float]:
        """``(prefix_len, prefix_bias)``: the leading keys that take an image bias, and that bias (``(0, 0.0)``:
        none). A full-grid call: the first frame's ``H' * W'`` keys with ``first_frame_bias`` (the first frame
        is the prefix of every order the engine runs, kernels/tile_order.py). A compact call in a token order:
        the same, or, where its layout leads with the last frame (``RegionLayout.end_image_leads``: the last
        frame's keys, then the first frame's), the last frame's keys with ``last_frame_bias``, and the first
        frame's after them where its bias is that value (Guidance Boost gives both one value) — with two other
        biases the call takes none (:attr:`end_image_in_prefix` False)."""
        first, last = float(self.first_frame_bias), float(self.last_frame_bias)
        if self.layout is None:
            tokens = self._frame_tokens()[1]
            return (tokens, first) if first and tokens else (0, 0.0)
        order = self.layout.order
        if order is None:
            return 0, 0.0
        tokens = order.first_frame_tokens
        if not self.layout.end_image_leads:
            return (tokens, first) if first else (0, 0.0)
        if last and first in (0.0, last):
            return (2 * tokens if first else tokens), last
        return 0, 0.0

    @property
    def end_image_in_prefix(self) -> bool:
        """Whether the end image's bias rides on the call's key prefix (:attr:`key_prefix`): a compact call
        whose layout leads with the last frame."""
        return self.layout is not None and self.layout.end_image_leads and self.key_prefix[0] > 0

    @property
    def suffix_len(self) -> int:
        """The last frame's token count when its bias applies (a full-grid call of more than one frame: the
        last frame is the raster sequence's suffix), else 0."""
        if not self.last_frame_bias or self.layout is not None:
            return 0
        frames, tokens = self._frame_tokens()
        return tokens if frames > 1 else 0

    def _frame_tokens(self) -> tuple[int, int]:
        """``(T', H' * W')`` of the grid when it holds this call's tokens (a full-grid call), else ``(0, 0)``."""
        try:
            t, h, w = (int(g) for g in self.grid)
        except (TypeError, ValueError):
            return 0, 0
        return (t, h * w) if t * h * w == self.q.shape[-2] and h * w > 0 else (0, 0)

    def dense(self, note=None) -> torch.Tensor:
        """The call's dense attention: the host's (or SDPA) with the first- and last-frame biases where they
        apply (:func:`~chorus.engine.guidance.biased_dense_or_plain`: plain if the biased call fails, after
        ``note(message)``). A compact call (``layout``) weights each pooled key by the tokens it stands for, as
        its sparse call does (:meth:`_compact_dense`): the attention of its full grid, read on its rows."""
        if self.layout is not None:
            return self._compact_dense(note)
        dense_fn = self.dense_fn or sdpa
        (prefix, prefix_bias), suffix = self.key_prefix, self.suffix_len
        if prefix or suffix:
            dense_fn = biased_dense_or_plain(dense_fn, prefix, prefix_bias, suffix, float(self.last_frame_bias),
                                             on_error=note)
        return dense_fn(self.q, self.k, self.v)

    def _compact_dense(self, note=None) -> torch.Tensor:
        """A compact call's dense attention: SDPA with a key bias of ``log(cell_size)`` on its cells (the
        sequence's last ``num_cells`` keys; each stands for ``cell_size`` tokens of identical q/k/v) and its
        image prefix bias (:attr:`key_prefix`); equal to :meth:`expanded`'s dense call read back on the compact
        rows (:meth:`compact`), at the compact length's cost. That expansion itself where an image bias does not
        ride on the key prefix (a raster layout; an end image in a layout that does not lead with it) and where
        the biased call fails (e.g. out of memory for the mask on a device without a fused masked kernel, after
        ``note(message)``)."""
        layout = self.layout
        prefix, prefix_bias = self.key_prefix
        if (self.first_frame_bias and not prefix) or (self.last_frame_bias and not self.end_image_in_prefix):
            return self.compact(self.expanded().dense(note))
        try:
            return image_biased_attention(self.q, self.k, self.v, prefix, prefix_bias, layout.num_cells,
                                          math.log(layout.cell_size))
        except Exception as exc:  # noqa: BLE001 - the exact expansion instead
            if note is not None:
                note(f"a compact call's dense attention ran on its full grid ({failure_text(exc)})")
            return self.compact(self.expanded().dense(note))

    def expanded(self) -> "AttnCall":
        """The call of a compact sequence carried to its full grid (every token takes its compact
        token's q/k/v, so each pooled key counts as the tokens it stands for); ``layout`` None."""
        layout = self.layout
        # expanded on [B, L, H, D]: the full tensors keep the token-major layout the host's views have
        full = [pooling.expand_tokens(t.transpose(1, 2), layout, dim=1).transpose(1, 2)
                for t in (self.q, self.k, self.v)]
        return replace(self, q=full[0], k=full[1], v=full[2], layout=None)

    def compact(self, out: torch.Tensor) -> torch.Tensor:
        """A full-grid output ``[B, H, L, D]`` of :meth:`expanded` back on this call's compact sequence."""
        return pooling.compact_rows(out, self.layout, dim=2)

    def positive_rows(self, keep_all: bool = False):
        """``(q, k)`` restricted to the positive-conditioning rows (chosen on the host: no device sync).
        No positive row: ``(None, None)``, or all rows with ``keep_all``. Positive rows that follow each
        other are views of q and k (no copy of a 14B call's tensors per recorded call). Raises
        :class:`Fallback` when ``cond_rows`` does not match the batch."""
        q, k = self.q, self.k
        if self.cond_rows is None:
            return q, k
        rows = torch.as_tensor(self.cond_rows, dtype=torch.bool, device="cpu").reshape(-1)
        if rows.numel() != q.shape[0]:
            raise Fallback(f"cond_rows has {rows.numel()} entries for a batch of {q.shape[0]}")
        keep = rows.nonzero().flatten().tolist()
        if not keep:
            return (q, k) if keep_all else (None, None)
        if len(keep) < q.shape[0]:
            if keep[-1] - keep[0] + 1 == len(keep):  # one run of rows (ComfyUI's cond chunk): views, no copy
                return q[keep[0]:keep[-1] + 1], k[keep[0]:keep[-1] + 1]
            return q[keep], k[keep]
        return q, k

    def check(self, num_layers: int, num_heads: int) -> tuple[int, int, int]:
        """The call's grid as ints; raises :class:`Fallback` when the call does not fit it or the model
        (tensors, shapes, tokens, layer, heads)."""
        q, k, v = self.q, self.k, self.v
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            raise Fallback("q/k/v are not tensors")
        if q.dim() != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
            raise Fallback(f"unexpected q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if self.sigma is None:
            raise Fallback("no sigma in this forward")
        tokens = q.shape[2]
        if self.layout is not None:  # the compact sequence of a full grid
            if tokens != self.layout.compact_length:
                raise Fallback(f"{tokens} tokens in a compact call, the layout has {self.layout.compact_length}")
            tokens = self.layout.length
        try:
            grid = tuple(int(g) for g in self.grid)
        except (TypeError, ValueError):
            raise Fallback(f"bad token grid {self.grid!r}") from None
        if len(grid) != 3 or grid[0] * grid[1] * grid[2] != tokens:
            raise Fallback(f"token grid {grid} does not hold the {tokens} tokens of this call "
                           "(extra reference / concatenated tokens?)")
        if not (0 <= int(self.layer) < max(num_layers, 1)):
            raise Fallback(f"layer index {self.layer} outside the model's {num_layers} layers")
        if q.shape[1] != num_heads:
            raise Fallback(f"{q.shape[1]} heads in the call, the model has {num_heads}")
        return grid
