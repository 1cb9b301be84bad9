"""Structured block maps for kernel benchmarks and GPU tests (not uniform random).

Wan token order is frame-major ``(t, h, w)`` after the 1x2x2 patchify; a 128-token block is located at
its centre token. A query block keeps the key blocks inside a 3D-local window (Chebyshev distance in
``(t, h, w)`` token units, scaled per head by an anisotropy pattern), plus the diagonal and a sparse
"sink" column: every 4th block of the first frame (keeping the whole first frame would already be
1/T of all blocks, ~5% at 81 frames, so a subset stands in for the image-condition column). The
window is grown (nearest pairs first) until the map holds the requested density of kept pairs.
"""

from __future__ import annotations

import torch

WAN_GRIDS = {32760: (21, 30, 52), 75600: (21, 45, 80)}  # 480p / 720p, 81 frames, after patchify
HEAD_PATTERNS = ((1.0, 1.0, 1.0), (0.5, 1.0, 1.0), (2.0, 0.7, 0.7), (1.0, 1.6, 0.6))


def grid_for(num_tokens: int) -> tuple[int, int, int]:
    """(T, H, W) token grid for a benchmark length: a Wan length, or a Wan length padded up to a multiple
    of 128 (32 768, 75 648: the pad tokens sit past the last frame); other lengths become 1 x 1 x L."""
    for length, grid in WAN_GRIDS.items():
        if length <= num_tokens < length + 128:
            return grid
    return (1, 1, num_tokens)


def structured_block_map(num_tokens: int, heads: int, density: float, block_size: int = 128,
                         device="cpu", grid=None, uniform_rows: bool = False) -> torch.Tensor:
    """bool ``[1, heads, nb, nb]`` with ~``density`` kept pairs per head (exactly 1.0 -> full map).

    ``uniform_rows``: every query block keeps the same number of key blocks, ``max(1, round(density * nb))``
    nearest by the same score (the forced diagonal and sink blocks first), for kernels that take one
    fixed count per call (cuDNN's SM90 FP8 block-sparse attention)."""
    nb = -(-num_tokens // block_size)
    if density >= 1.0:
        return torch.ones(1, heads, nb, nb, dtype=torch.bool, device=device)
    t_n, h_n, w_n = grid or grid_for(num_tokens)
    centre = torch.clamp(torch.arange(nb, device=device) * block_size + block_size // 2, max=num_tokens - 1)
    pos = torch.stack([centre // (h_n * w_n), (centre // w_n) % h_n, centre % w_n], dim=-1).double()
    diff = (pos[:, None, :] - pos[None, :, :]).abs()  # [nb, nb, 3]
    frame_blocks = -(-(h_n * w_n) // block_size)
    sink = torch.zeros(nb, dtype=torch.bool, device=device)
    sink[: min(frame_blocks, nb): 4] = True
    eye = torch.eye(nb, dtype=torch.bool, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    jitter = (torch.rand(nb, nb, generator=gen, dtype=torch.float64) * 1e-3).to(device)
    forced = sink[None, :] | eye
    maps = []
    for head in range(heads):
        aniso = torch.tensor(HEAD_PATTERNS[head % len(HEAD_PATTERNS)], device=device, dtype=torch.float64)
        scaled = diff / aniso
        # Chebyshev window, ties broken by Euclidean distance then a tiny fixed jitter
        score = scaled.amax(-1) + 0.05 * scaled.norm(dim=-1) + jitter
        score = score.masked_fill(forced, -1.0)
        if uniform_rows:
            count = min(nb, max(1, int(round(density * nb))))
            keep = torch.zeros(nb, nb, dtype=torch.bool, device=device)
            keep.scatter_(1, score.topk(count, dim=1, largest=False).indices, True)
            maps.append(keep)
            continue
        want = max(int(round(density * nb * nb)), int(forced.sum()))
        threshold = score.flatten().kthvalue(want).values
        maps.append(score <= threshold)
    return torch.stack(maps)[None]


def kept_flops(block_map: torch.Tensor, q_len: int, kv_len: int, head_dim: int, block_size: int = 128,
               batch: int = 1, heads: int | None = None) -> float:
    """Forward attention FLOPs on kept blocks, partial blocks counted exactly: 4 * D * sum(rows * cols)."""
    qb, kb = block_map.shape[-2:]
    rows = torch.full((qb,), block_size, dtype=torch.float64, device=block_map.device)
    rows[-1] = q_len - (qb - 1) * block_size
    cols = torch.full((kb,), block_size, dtype=torch.float64, device=block_map.device)
    cols[-1] = kv_len - (kb - 1) * block_size
    pairs = torch.einsum("bhij,i,j->bh", block_map.double(), rows, cols)
    pairs = pairs.expand(batch, heads or block_map.shape[1]).sum().item()
    return 4.0 * head_dim * pairs
