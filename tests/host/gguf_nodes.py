"""Test helpers: the ComfyUI-GGUF custom node pack (Unet Loader (GGUF)) in-process, and tiny Wan GGUF files.

ComfyUI-GGUF is a custom node pack, not an installable package: it is found through env
``CHORUS_GGUF_NODES_DIR`` (the pack's folder), else in ``custom_nodes/`` of the ComfyUI checkout
:mod:`tiny_wan` found (``ComfyUI-GGUF`` or ``comfyui-gguf``, the names a manual clone and the registry
give it). Its one PyPI dependency, ``gguf``, writes the files here (test-only; the nodes never read
GGUF themselves). Nothing of the pack is copied: it is imported from where the user has it.

:func:`save_gguf` writes a state dict as the pack's own converter lays a Wan file out (architecture
``wan``; 1-dim and small tensors and the modulation F32; larger ones in ``qtype``, F16 where their rows do not split into
its blocks; tensors of more than 4 dims flattened
to 2 with their shape in ``comfy.gguf.orig_shape.<name>``), so the loader reads it as it reads a
published Wan 2.2 GGUF.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

from host import tiny_wan

PACK_DIR_NAMES = ("ComfyUI-GGUF", "comfyui-gguf")
SMALL_TENSOR = 1024  # elements: the converter keeps tensors this small in F32
HIGH_PRECISION = (".modulation",)  # plain parameters the loader copies as stored: the converter keeps them F32

_STATE: dict = {}


def find_gguf_nodes() -> Path | None:
    candidates = []
    if os.environ.get("CHORUS_GGUF_NODES_DIR"):
        candidates.append(Path(os.environ["CHORUS_GGUF_NODES_DIR"]))
    comfy_dir = tiny_wan.find_comfyui_dir()
    if comfy_dir is not None:
        candidates += [comfy_dir / "custom_nodes" / name for name in PACK_DIR_NAMES]
    for path in candidates:
        if (path / "nodes.py").is_file() and (path / "ops.py").is_file() and (path / "loader.py").is_file():
            return path
    return None


def import_gguf_nodes():
    """``(nodes module of ComfyUI-GGUF, None)``, or ``(None, why not)`` (ComfyUI, the pack or ``gguf`` missing)."""
    if "result" in _STATE:
        return _STATE["result"]
    reason = tiny_wan.import_comfy()
    module = None
    if reason is None:
        pack = find_gguf_nodes()
        if pack is None:
            reason = ("no ComfyUI-GGUF checkout (set CHORUS_GGUF_NODES_DIR, or clone it into ComfyUI's custom_nodes/)")
        else:
            try:
                import gguf  # noqa: F401
            except ImportError:
                reason = "the gguf package is not installed (pip install gguf)"
            else:
                if str(pack.parent) not in sys.path:
                    sys.path.insert(0, str(pack.parent))  # the pack imports itself as a package, as ComfyUI loads it
                try:
                    module = importlib.import_module(f"{pack.name}.nodes")
                except Exception as exc:  # noqa: BLE001 - a pack that does not import is a skip reason
                    reason = f"ComfyUI-GGUF at {pack} does not import: {type(exc).__name__}: {exc}"
    _STATE["result"] = (module, reason)
    return _STATE["result"]


def save_gguf(state_dict: dict, path, qtype: str = "Q8_0") -> Path:
    """Write ``state_dict`` (a ComfyUI Wan state dict) as a GGUF file with its large tensors in ``qtype``
    (a ``gguf.GGMLQuantizationType`` name that the ``gguf`` package can quantize: Q8_0, Q4_0, Q5_1, BF16, F16)."""
    import gguf
    import numpy as np

    quant = getattr(gguf.GGMLQuantizationType, qtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "wan")
    for name, tensor in state_dict.items():
        data = tensor.detach().to(torch.float32).numpy()
        if data.ndim > 4:
            writer.add_array(f"comfy.gguf.orig_shape.{name}", [int(d) for d in data.shape])
            data = data.reshape(data.shape[0], -1)
        kind = gguf.GGMLQuantizationType.F32
        if data.ndim > 1 and data.size > SMALL_TENSOR and not any(key in name for key in HIGH_PRECISION):
            kind = quant
        try:
            packed = gguf.quants.quantize(np.ascontiguousarray(data), kind)
        except gguf.QuantError:  # rows not a whole number of the type's blocks: F16, as the converter falls back
            kind = gguf.GGMLQuantizationType.F16
            packed = gguf.quants.quantize(np.ascontiguousarray(data), kind)
        writer.add_tensor(name, packed, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
