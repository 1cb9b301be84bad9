"""Where the host waits for the GPU in the benchmark of record: every synchronizing CUDA call of a run
(``torch.cuda.set_sync_debug_mode("warn")``), counted by its Python stack (the last 7 frames of the
project, ComfyUI and torch). A sync inside a sampled step stalls the host's queue of kernels: the GPU idles
while the host catches up, which a kernel profile does not show.

``python -m benchmarks.comfy_e2e.syncs --out OUT RUN.PY ARGUMENTS`` (e.g. ``--res 480p --layers 2 --variants
dense miss``): runs ``benchmarks.comfy_e2e.run`` with those arguments, then writes ``OUT/syncs.json`` (the 60
most frequent sites, each ``{"count", "site": [message, frame, ...]}``, innermost frame last) and prints it.
Needs a CUDA device (the CPU has no synchronizing calls to report).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
import warnings

import torch

OWN_FRAMES = ("/chorus/", "benchmarks", "/comfy/", "nodes.py", "comfy_extras", "torch/_")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in argv:
        raise SystemExit("--out DIR is required (syncs.json and the run's own files go there)")
    out_dir = argv[argv.index("--out") + 1]
    sites: collections.Counter = collections.Counter()

    def count(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if any(t in f.filename for t in OWN_FRAMES)]
        key = (str(message)[:80],) + tuple(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[-7:])
        sites[key] += 1

    from . import run

    warnings.showwarning = count
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        run.main(argv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        table = [{"count": n, "site": list(k)} for k, n in sites.most_common(60)]
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "syncs.json"), "w") as f:
            json.dump(table, f, indent=1)
        print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
