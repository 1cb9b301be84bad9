"""Numerics for Chorus II: block-sparse attention, block mass, mask selection and codecs.

Importing this package needs only torch (Triton kernels load lazily on first GPU use).
"""

from .api import (Backend, BackendUnavailableError, auto_chain, block_mass, block_sparse_attention,
                  has_pooled_tail, resolve_backend)
from .codec import (decode_block_map, encode_block_map, from_flex_block_mask, pack_bits, to_flex_block_mask,
                    unpack_bits)
from .masks import (density, first_frame_blocks, last_frame_blocks, num_blocks, select_blocks, select_blocks_packed,
                    validate_block_map)
from .refresh import VisitRefresh
from .resample import aspect_matches, resample_block_map, resample_region_scores

__all__ = [
    "Backend", "BackendUnavailableError", "block_sparse_attention", "block_mass", "resolve_backend", "auto_chain",
    "has_pooled_tail",
    "select_blocks", "select_blocks_packed", "validate_block_map", "num_blocks", "density", "first_frame_blocks",
    "last_frame_blocks",
    "pack_bits", "unpack_bits", "encode_block_map", "decode_block_map", "to_flex_block_mask",
    "from_flex_block_mask", "resample_block_map", "resample_region_scores", "aspect_matches", "VisitRefresh",
]
