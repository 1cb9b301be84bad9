"""The benchmark of record: Chorus II inside ComfyUI's own ``WanModel``, driven through the nodes.

``python -m benchmarks.comfy_e2e.run --comfyui DIR --out OUT [--model a14b | ti2v5b] [--res 480p 720p]
[--weights bf16 fp16 fp8 fp8_scaled] [--variants dense miss hit15 hit5 hitfr] [--compile [--guard-filter]] [--layers 40] [--profile]
[--frames N --windows LENGTH OVERLAP [--window-schedule NAME]]``
(``--tiny``: the same code at toy sizes and at most 4 steps, on the CPU, for tests; ``--profile``: one more
step of each variant under ``torch.profiler``, its top kernels by GPU time in the JSON, and a hit's attention
call's kernels beside its per-call time in the table).

What runs (everything side by side in one process, one GPU):

* ``--model a14b`` (the default): two random-weight experts of the Wan 2.2 A14B I2V shape (dim 5120, 40 layers,
  40 heads x 128, FFN 13 824, in_dim 36, text 4096 x 512 tokens); ``--model ti2v5b``: one model of the Wan 2.2
  TI2V 5B shape (dim 3072, 30 layers, 24 heads x 128, FFN 14 336, in_dim / out_dim 48). Built by ComfyUI
  itself: ``model_detection`` of the state-dict shapes, ``model_config.get_model`` (``model_base.WAN21`` with ``comfy.ldm.wan.model.WanModel``
  and the operations ComfyUI picks for the weight dtype), weights initialised in place on the GPU, one
  ``ModelPatcher`` each. ``--weights bf16``: bf16 weights, ComfyUI's default ops. ``--weights fp16``: the same in
  fp16, the dtype ComfyUI's loader computes a Wan model in on a GPU with fp16 (sm >= 8) from an fp16 or bf16 file
  (Wan lists fp16 first among its inference dtypes; bf16 is a user's ``--bf16-unet``). ``--weights fp8``:
  ComfyUI's FP8 weights path -- ``weight_dtype fp8_e4m3fn_fast`` of UNETLoader (e4m3 weights,
  ``fp8_optimizations``) with ``--fast fp8_matrix_mult``, i.e. ``comfy.ops.fp8_ops`` (``torch._scaled_mm``).
  ``--weights fp8_scaled``: the layout of the files the shipped workflows name (``*_fp8_scaled.safetensors``: e4m3
  linear weights with per-tensor scales, ``fp8_scaled.py``) loaded by ComfyUI's ``load_diffusion_model_state_dict``
  as UNETLoader loads them at ``weight_dtype`` default (0.3.64: ``scaled_fp8_ops``; 0.28.2 on: its mixed-precision
  operations, an FP8 GEMM per linear on a GPU that has them).
* A request (:class:`Workflow`), as the shipped workflow runs it: A14B, ComfyUI's ``KSamplerAdvanced`` twice,
  high-noise expert steps 0-2 of 4 (noise added, leftover noise returned), low-noise expert steps 2-4, euler /
  simple, cfg 1, batch 1, 81 frames (21 latent frames), Wan I2V conditioning (``concat_latent_image``,
  ``concat_mask`` as ``WanImageToVideo`` makes them; random text embeddings; ``--end-image``: as
  ``WanFirstLastFrameToVideo`` makes them, an end image on the last latent frame too, each row's ``image_frames``
  what its run read); TI2V 5B, one ``KSamplerAdvanced``
  over 20 steps, uni_pc / simple, cfg 5 (each step runs the model on the positive and the negative prompt),
  1280 x 704, 121 frames (31 latent frames of 48 channels, Wan 2.2's VAE: 27 280 tokens), the start image's latent
  in the first frame with the ``noise_mask`` that keeps it (as ``Wan22ImageToVideoLatent`` makes them).
* ``--frames N --windows LENGTH OVERLAP [--window-schedule NAME]``: a longer request (N pixel frames) whose every
  row runs its models through the core "WAN Context Windows (Manual)" node (windows of LENGTH frames overlapping by
  OVERLAP in the schedule NAME, ``standard_static`` unless named, the node's defaults otherwise; ComfyUI 0.28.2 or later, whose Wan node runs them with its causal window fix: every window
  but the first one frame longer); the hits' entry is the miss's, recorded at the first window's grid, and the JSON
  says which latent frames each window held (``windows``) and each row's feature-reuse block counts.
* ``--hit-backends auto fa4_bf16 triton_bf16``: hit15 / hit5 once per sparse-attention backend of
  ``ChorusSparseSampler`` (rows ``hit15@fa4_bf16`` ...; ``auto`` is the plain row).
* Variants: ``dense`` (the unpatched models: ComfyUI's default attention, SDPA in the host's backend order:
  cuDNN attention first in 0.3.64 and 0.28.2, flash first and cuDNN second in 0.33.0 and 0.38.x; the JSON's
  ``comfyui`` and ``sdpa_order`` say which); ``dense_cudnn`` (the same with cuDNN attention moved first, the
  older order, on any host: :func:`host_attention.sdpa_cudnn_first`); ``dense_ck`` (the models through
  ComfyUI's core "Model Attention Backend" node at "comfy kitchen attention", 0.33.0 and 0.38.x: comfy-kitchen's
  dense INT8 attention in every attention call, what ComfyUI's ``--use-ck-attention`` makes global; skipped with
  the reason where the host has no such node or comfy-kitchen no INT8 kernel for the device:
  :func:`host_attention.comfy_kitchen_attention_models`);
  ``dense_rowmajor`` (the same, each block on a row-major copy of its input, as Chorus's block patch runs every
  block of a patched model: ComfyUI hands them the patch embedding's transposed view, which Wan 2.2 TI2V 5B's
  per-token modulation makes costly; :func:`host_attention.row_major_models`);
  ``miss`` (``ChorusMaskRetrieve`` on an empty workspace -> ``ChorusSparseSampler`` +
  ``ChorusFeatureReuse`` on both models -> sampling = dense + recording -> ``ChorusCacheWrite`` writes the
  entry); ``hit15`` / ``hit5`` (the miss's entry with its maps replaced by structured maps of 15% / 5%
  density -- random weights have near-uniform attention, so recorded maps say nothing about speed --
  written to a workspace of its own; ``ChorusMaskRetrieve`` finds it, ``ChorusSparseSampler`` patches both
  models; the similarity threshold is the node's default); ``hitfr`` (hit15 + ``ChorusFeatureReuse``
  at ``downsample_share`` 0.25, ``--fr-share``, with the region scores the miss recorded; the miss runs
  feature reuse at the same share, so its entry is in the region order: ``*_raster`` rows are the same
  requests on that entry relabelled raster); ``hitfr_gb`` (hitfr + ``ChorusGuidanceBoost`` at its defaults, the
  shipped feature-reuse workflow's node chain: the row's ``guidance`` counts the biased self-attention calls and the
  forwards whose cross-attention outputs it boosted, over its warm-up step and request; compiled, over its timed
  request). Every hit row runs
  ``ChorusSparseSampler``'s defaults, the pooled tail on; ``hit15_notail`` / ``hit5_notail``: the same requests
  with it off. ``sol`` / ``sol_every``:
  ComfyUI's own sparse attention (the core "Model Sparse Attention" node of ComfyUI 0.38.x, rebuilt on this
  host's override hook by ``sol_peer.py``, ``comfy_kitchen.sol_attn`` with tau 1.3 and ``token_aug`` 256):
  the node's default window (the first 20% of the schedule dense) / every step. ``--compile``: each of ``dense``,
  ``miss``, ``hit15``, ``hit15_notail``, ``hitfr`` and ``hitfr_gb`` asked for runs again on models passed through
  ComfyUI's ``TorchCompileModel`` node (inductor; rows ``*+compile``); their warm-up is a whole request, whose time
  (compilation included) is the row's ``first_request_s``, and what compiling took in it
  ``first_request_compile`` (dynamo and inductor, and each Triton kernel built: :class:`CompileLog`); the timed
  request is the next one in which dynamo compiles nothing (up to ``STEADY_RETRIES`` more requests: ComfyUI's
  loading may change what the graph guards, e.g. its ``comfy_cast_weights`` flags, and a request that recompiles
  times the compiler; those are in ``unsteady_requests``); each recompile of the row's requests is in
  ``dynamo.recompile_reasons`` (:class:`RecompileLog`). A compiled row that raises (ComfyUI 0.33.0's own compiled
  FP8-scaled linears do under torch 2.11: docs/BENCHMARK_LOG.md, run 120) is a row with ``failed`` (the error's first
  line) and no time; the rows after it run, and the command exits 1.
  ``--guard-filter``: compile as later ComfyUI's ``TorchCompileModel`` does by default, with no dynamo guard
  on ``transformer_options``, on a host whose node does not (0.3.64; ``compile_guard_filter`` in the JSON says
  which way the rows compiled).
  ``--compiled-only``: those rows alone, each compared with ``dense+compile`` (a hit still needs the entry the
  eager miss writes: that miss runs and is reported), so a 720p compiled comparison fits one shorter run.
* Timing: each variant runs one warm-up step (the first model, step 0 -> 1: Triton and cuDNN compile there),
  then one timed request (``torch.cuda.synchronize`` + wall clock around both KSamplerAdvanced calls).
  Per-layer self-attention time: an outermost attention override (ComfyUI's chaining mechanism) puts
  CUDA events around every self-attention call of the high-noise expert (or the one model) in the timed request
  (A14B: 2 steps x 40 layers; no host sync is added). Under compile that override would be traced into the graph,
  so compiled Chorus rows time each ``torch.ops.chorus.attend`` call from the inside (CUDA events
  around the op's work, which runs eagerly in the compiled graph; ``attn_ms_*`` of those rows).
  ``kernel alone``: ``chorus.kernels.block_sparse_attention`` with ``backend="auto"`` (the backend a
  hit runs; its name is in the row; a ``--hit-backends`` row times its own backend) on random q/k/v in
  ComfyUI's layout with the map of layer 0 the hit used (entry map + k_min floor), timed the same way; the
  hit's per-layer time over it is what the integration costs per call (the table's "alone"). The GPU's SM
  clock and power are sampled (NVML, every 50 ms) during each timed request (``gpu``) and during the
  kernel-alone timing (``kernel_alone_ms.gpu_auto``, or ``gpu_<backend>``): the same kernel runs slower at
  the clock a GPU holds under the model's GEMMs than in a loop on an idle one, so it is timed a second way,
  each call between the GEMMs of one block's linears (``auto_under_load``, the table's "between GEMMs";
  its clock in ``gpu_auto_under_load``; ``kernel_alone.py``). A compiled hit 15% row times the kernel alone too (the
  portable kernel's parts only with ``--compiled-only``: the eager row timed them otherwise). Retrieval and
  cache-write times are reported separately (they run on the CPU before / after sampling). ``comfy_loading``:
  whether ComfyUI loaded both experts whole for the timed request (:func:`experts.loading_state`; two bf16 A14B experts
  take 53 GiB, so on an 80 GB card it may load them partially, and the table marks such a row).

Writes ``OUT/comfy_e2e.json`` (every number) and prints a table. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from .compiling import (STEADY_RETRIES, CompileLog, RecompileLog, compiled_frames, dynamo_summary,
                        host_compiles_with_guard_filter, torch_compile_model)
from .experts import build_expert, import_comfy, loading_state
from .host_attention import comfy_kitchen_attention_models, row_major_models, sdpa_cudnn_first, sdpa_order
from .kernel_alone import kernel_alone_ms
from .profiling import attention_kernels_ms, profile_step
from .report import attention_call_fields, plan_fields, save, table
from .timers import OpTimer, with_timer
from .windows import WINDOW_SCHEDULES, context_windows, host_runs_i2v_in_windows, windows_of

A14B = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_dim=36, out_dim=16, text_dim=4096,
            freq_dim=256)
TI2V_5B = dict(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48, text_dim=4096,
               freq_dim=256)
TINY = dict(dim=256, ffn_dim=512, num_heads=2, num_layers=2, text_dim=4096, freq_dim=256)
TINY_MAX_STEPS = 4  # --tiny: a 20-step workflow samples 4 steps of the same sampler and cfg (the CPU tests)


@dataclasses.dataclass(frozen=True)
class Workflow:
    """What one request of a shipped workflow runs (``--model``).

    ``shape``: the ``WanModel`` of each expert (the toy run keeps its ``in_dim`` / ``out_dim``);
    ``resolutions``: name -> (height px, width px, frames); ``latent_channels`` / ``vae_stride``: the VAE's latent
    (Wan 2.1 VAE 16 channels, 8x; Wan 2.2 VAE 48, 16x); ``experts``: 2 = a high-noise expert for steps
    ``[0, switch)`` and a low-noise one after it (two ``KSamplerAdvanced`` calls), 1 = one model for every step;
    ``image_in_channels``: the start image enters as ``concat_latent_image`` / ``concat_mask`` (Wan I2V, as
    ``WanImageToVideo`` makes them), else as the latent's first frame with a ``noise_mask`` that keeps it (as
    ``Wan22ImageToVideoLatent`` makes them: Wan 2.2 TI2V 5B)."""

    label: str
    shape: dict
    resolutions: dict
    latent_channels: int
    vae_stride: int
    experts: int
    steps: int
    switch: int
    cfg: float
    sampler: str
    image_in_channels: bool

    def latent_shape(self, res: str, frames: int | None = None) -> tuple:
        """``[B, C, T, H, W]`` of a request at ``res`` (``frames``: pixel frames instead of the resolution's)."""
        h_px, w_px, own_frames = self.resolutions[res]
        frames = own_frames if frames is None else frames
        return 1, self.latent_channels, (frames - 1) // 4 + 1, h_px // self.vae_stride, w_px // self.vae_stride


WORKFLOWS = {
    "a14b": Workflow("Wan 2.2 A14B I2V, 4-step LoRA: 2 + 2 steps, euler, cfg 1 (workflows/chorus_wan22_a14b_i2v_4step)",
                     A14B, {"480p": (480, 832, 81), "720p": (720, 1280, 81), "tiny": (128, 224, 13)},
                     latent_channels=16, vae_stride=8, experts=2, steps=4, switch=2, cfg=1.0, sampler="euler",
                     image_in_channels=True),
    "ti2v5b": Workflow("Wan 2.2 TI2V 5B: 20 steps, uni_pc, cfg 5 (workflows/chorus_wan22_ti2v_5b)",
                       TI2V_5B, {"720p": (704, 1280, 121), "tiny": (256, 448, 13)},
                       latent_channels=48, vae_stride=16, experts=1, steps=20, switch=20, cfg=5.0, sampler="uni_pc",
                       image_in_channels=False),
}
TEXT_TOKENS = 512
HIT_DENSITY = {"hit15": 0.15, "hit5": 0.05, "hitfr": 0.15, "hitver": 0.15, "hit15_raster": 0.15,
               "hitfr_raster": 0.15, "hit15_notail": 0.15, "hit5_notail": 0.05, "hitfr_gb": 0.15}
# *_notail: the same request with ChorusSparseSampler's pooled_tail off (every other row: the node's default, on)
NO_TAIL_VARIANTS = ("hit15_notail", "hit5_notail")
# *_raster: the same request on an entry in raster order (what a miss without feature reuse records; a
# miss with it records the region order, in which hitfr's downsampled blocks attend on the compact sequence)
RASTER_VARIANTS = ("hit15_raster", "hitfr_raster")
# hitver: hit15 with self-verification on; 0.01 passes on random weights (a map keeps about its density
# of near-uniform attention), so the request does the verification work and stays a hit: its overhead
VERIFY_THRESHOLD_PASSING = 0.01
# hitfr_gb: hitfr + ChorusGuidanceBoost at the node's defaults (text 0.5, image 0.5, cfg 0), the node chain of the
# shipped feature-reuse workflow (workflows/chorus_wan22_a14b_i2v_4step_feature_reuse)
GUIDED_VARIANTS = ("hitfr_gb",)
FEATURE_REUSE_VARIANTS = ("hitfr", "hitfr_raster") + GUIDED_VARIANTS
HIT_VARIANTS = ("hit15", "hit5", "hitfr", "hitver") + RASTER_VARIANTS + NO_TAIL_VARIANTS + GUIDED_VARIANTS
# the hits that --compile also runs under TorchCompileModel (with dense and miss)
COMPILED_HITS = ("hit15", "hit15_notail", "hitfr") + GUIDED_VARIANTS
# ComfyUI's core sparse attention (sol_peer.py): "sol" with the core node's defaults (the first 20% of the
# schedule dense), "sol_every" with start_percent 0 (sol_attn at every step)
SOL_VARIANTS = {"sol": 0.2, "sol_every": 0.0}


def conditioning(workflow: Workflow, latent_shape, seed: int, end_image: bool = False):
    """``(positive, negative, latent)`` as the workflow's nodes shape them, random text embeddings
    ``[1, 512, 4096]`` and a random start-image latent on the first latent frame: Wan I2V (``WanImageToVideo``)
    carries that frame's latent video and a mask (0 on the first frame) in the conditioning beside a zero latent;
    Wan 2.2 TI2V 5B (``Wan22ImageToVideoLatent``) puts it in the latent's first frame with a ``noise_mask``
    (0 there: the frame is kept, and the model's per-frame timestep is 0 on it). ``end_image`` (Wan I2V only):
    an end image on the last latent frame too, as ``WanFirstLastFrameToVideo`` conditions."""
    gen = torch.Generator().manual_seed(seed)
    _, c, t, h, w = latent_shape
    image = torch.randn(1, c, t, h, w, generator=gen) * 0.5
    mask = torch.ones(1, 1, t, h, w)
    mask[:, :, :1] = 0.0
    if end_image:
        mask[:, :, -1:] = 0.0
    extra = {"concat_latent_image": image, "concat_mask": mask} if workflow.image_in_channels else {}

    def cond(s):
        text = torch.randn(1, TEXT_TOKENS, 4096, generator=torch.Generator().manual_seed(s))
        return [[text, dict(extra)]]

    if workflow.image_in_channels:
        latent = {"samples": torch.zeros(latent_shape)}
    else:
        latent = {"samples": torch.where(mask.bool(), 0.0, image), "noise_mask": mask}
    return cond(seed), cond(seed + 1), latent


def start_image_pixels(workflow: Workflow, res: str, seed: int) -> torch.Tensor:
    """A start image ``[1, H, W, 3]`` in [0, 1] (what LoadImage gives; only its pixels are embedded)."""
    h, w, _ = workflow.resolutions[res]
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(1, h // 8, w // 8, 3, generator=gen).repeat_interleave(8, 1).repeat_interleave(8, 2)


def sample_request(workflow: Workflow, models, latent, positive, negative, seed: int, *, end_step=None):
    """One request of the workflow through ``KSamplerAdvanced``, scheduler ``simple``: with two experts the
    high one for steps ``[0, switch)`` (leftover noise returned) and the low one after it; with one model every
    step in one call. ``end_step``: stop there (a warm-up; up to the switch only the high expert runs). Without
    autograd, as in ComfyUI, whose executor runs every node under ``torch.inference_mode``: its k-diffusion
    samplers (euler) carry ``torch.no_grad`` themselves, uni_pc does not and would keep every block's activations."""
    with torch.no_grad():
        return _sample_request(workflow, models, latent, positive, negative, seed, end_step)


def _sample_request(workflow: Workflow, models, latent, positive, negative, seed: int, end_step):
    import nodes

    ks = nodes.KSamplerAdvanced()
    steps, cfg, sampler = workflow.steps, workflow.cfg, workflow.sampler
    if workflow.experts == 1 or (end_step is not None and end_step <= workflow.switch):
        last = end_step if end_step is not None else 10000
        return ks.sample(models[0], "enable", seed, steps, cfg, sampler, "simple", positive, negative, latent, 0, last,
                         "enable" if end_step is not None else "disable")[0]
    high, low = models
    mid = ks.sample(high, "enable", seed, steps, cfg, sampler, "simple", positive, negative, latent, 0, workflow.switch,
                    "enable")[0]
    return ks.sample(low, "disable", seed, steps, cfg, sampler, "simple", positive, negative, mid, workflow.switch, 10000,
                     "disable")[0]


def structured_map(grid, heads: int, density: float, block_size: int, device, seed: int, order=None) -> torch.Tensor:
    """Bool ``[H, Qb, Kb]``: per head, each query block keeps the ``round(density * Kb)`` key blocks
    nearest to it in 3D (block centroids in (t, h, w) token units, head-specific anisotropy, e.g.
    temporal heads that reach other frames at the same place), always including itself. ``order``: the
    token order the blocks are cut from (a ``chorus.kernels.tile_order`` order; None = raster)."""
    t, h, w = grid
    L = t * h * w
    nb = -(-L // block_size)
    idx = torch.arange(L, device=device)
    tok = idx if order is None else order.perm.to(device)  # the raster token at each position
    coords = torch.stack([tok // (h * w), (tok // w) % h, tok % w], -1).float()
    blk = torch.zeros(nb, 3, device=device).index_add_(0, idx // block_size, coords)
    blk /= torch.bincount(idx // block_size, minlength=nb).float()[:, None]
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = torch.rand(heads, 3, device=device, generator=gen) * torch.tensor([4.0, 1.0, 1.0], device=device) + 0.05
    diff = (blk[:, None, :] - blk[None, :, :]) ** 2                      # [Qb, Kb, 3]
    dist = torch.einsum("qkc,hc->hqk", diff, weights)
    dist += 1e-3 * torch.rand(dist.shape, device=device, generator=gen)
    keep = max(1, round(density * nb))
    order = dist.topk(keep, dim=-1, largest=False).indices
    out = torch.zeros(heads, nb, nb, dtype=torch.bool, device=device)
    out.scatter_(-1, order, True)
    diag = torch.arange(nb, device=device)
    out[:, diag, diag] = True
    return out


def structured_maps(grid, heads: int, density: float, layers: int, device, order=None) -> dict:
    """One structured map per layer (:func:`structured_map`: per head the key blocks nearest in 3D with
    head-specific anisotropy, exactly ``density`` of them per row), cut in the entry's token ``order``
    (None = raster)."""
    return {layer: structured_map(grid, heads, density, 128, device, seed=100 + layer, order=order).cpu()
            for layer in range(layers)}


def run(args) -> dict:
    """Every row of the command: per ``--weights`` the experts are built once, and per ``--res`` their rows run
    (:class:`Rows`). Returns the results (``save`` writes them as they come)."""
    cpu = args.tiny or not torch.cuda.is_available()
    comfy_dir = Path(args.comfyui or os.environ.get("COMFYUI_DIR", ""))
    import_comfy(comfy_dir, cpu)
    if args.windows and not host_runs_i2v_in_windows():
        raise SystemExit("--windows needs ComfyUI 0.28.2 or later: this one samples no Wan I2V model in context "
                         "windows")
    device = torch.device("cpu" if cpu else "cuda")
    root = Path(tempfile.mkdtemp(prefix="chorus_comfy_e2e_"))
    os.environ["CHORUS_CACHE_DIR"] = str(root)
    from chorus.nodes.host_report import comfyui_version

    workflow = WORKFLOWS[args.model]
    if args.tiny and workflow.steps > TINY_MAX_STEPS:
        workflow = dataclasses.replace(workflow, steps=TINY_MAX_STEPS, switch=min(workflow.switch, TINY_MAX_STEPS))
    shape = dict(TINY, in_dim=workflow.shape["in_dim"], out_dim=workflow.shape["out_dim"]) if args.tiny else workflow.shape
    if args.layers:
        shape = dict(shape, num_layers=args.layers)
    results = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if not cpu else "cpu",
               "torch": torch.__version__, "workflow": workflow.label + (
                   "; a start and an end image (WanFirstLastFrameToVideo)" if args.end_image else ""),
               "shape": shape, "steps": workflow.steps, "comfyui": comfyui_version(), "sdpa_order": sdpa_order(),
               "runs": []}
    if not cpu:
        import triton

        from chorus.kernels.triton import _ptxas

        results["triton"] = triton.__version__
        results["ws_assembler"] = _ptxas.describe()
        print(f"triton {triton.__version__}; warp-specialised kernel: {results['ws_assembler']}", flush=True)
    t_start = time.perf_counter()
    sampler = gpu_sampler(device)
    for weights in args.weights:
        built = [build_expert(shape, weights, seed, device) for seed in (1, 2)[:workflow.experts]]
        experts = tuple(patcher for patcher, _ in built)
        results.setdefault("ops", {})[weights] = built[0][1]
        for res in args.res:
            Rows(args, results, workflow, shape, experts, weights, res, device, sampler, t_start).run()
        built = experts = None  # the experts' weights go before the next --weights builds its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["wall_s"] = time.perf_counter() - t_start
    return results


class Rows:
    """The rows of one ``--weights`` x ``--res``, in the order the module docstring gives: dense and its
    reference rows, ComfyUI's sparse attention, the miss that writes the entry, each hit on a structured copy of
    it, and their compiled twins. Each row appends to ``results["runs"]`` and saves; ``experts`` are the built
    models (one or two ``ModelPatcher``), never patched in place."""

    def __init__(self, args, results: dict, workflow: Workflow, shape: dict, experts: tuple, weights: str, res: str,
                 device: torch.device, sampler, t_start: float):
        from chorus.engine import token_grid

        self.args, self.results, self.workflow, self.shape = args, results, workflow, shape
        self.experts, self.weights, self.res, self.device = experts, weights, res, device
        self.sampler, self.t_start = sampler, t_start
        self.lat_shape = workflow.latent_shape(res, args.frames)
        self.grid = token_grid(self.lat_shape)
        self.positive, self.negative, self.latent = conditioning(workflow, self.lat_shape, 7, end_image=args.end_image)
        self.pixels = start_image_pixels(workflow, res, 3)
        self.ws_miss, self.ws_hit = f"bench_{weights}_{res}_miss", f"bench_{weights}_{res}_hit"
        self.compiling = args.compile and res in args.compile_res
        self.fresh = iter(range(10 ** 6))  # a compiled miss's workspace of its own

    def run(self) -> None:
        args = self.args
        self.dense_rows()
        for name, start in SOL_VARIANTS.items():
            if name in args.variants:
                self.sol_row(name, start)
        entry_plan = None
        needs_entry = any(v in args.variants for v in HIT_VARIANTS)
        if needs_entry or ("miss" in args.variants and not args.compiled_only):
            entry_plan = self.miss_row()
        for name in HIT_VARIANTS:
            if name in args.variants and entry_plan is not None:
                self.hit_rows(name, entry_plan)
        if self.compiling and "miss" in args.variants and (entry_plan is not None or args.compiled_only):
            self.timed_compiled("miss")  # (each compiled miss records into a fresh workspace of its own)

    # -- the models of a row ------------------------------------------------------------------------------------

    def windowed(self, models) -> tuple:
        """``models`` in context windows with ``--windows``, else as they are."""
        if not self.args.windows:
            return tuple(models)
        wrapped = tuple(context_windows(m, *self.args.windows, self.args.window_schedule) for m in models)
        self.results["windows"] = {"context_length": self.args.windows[0], "context_overlap": self.args.windows[1],
                                   "context_schedule": self.args.window_schedule,
                                   "latent_frames": self.lat_shape[2],
                                   "windows": windows_of(wrapped[0], self.lat_shape[2])}
        return wrapped

    def retrieve(self, workspace: str):
        """``(plan, seconds)``: ``ChorusMaskRetrieve`` on ``workspace`` for this request."""
        from chorus.nodes.mask_retrieve import ChorusMaskRetrieve

        t0 = time.perf_counter()
        plan = ChorusMaskRetrieve.execute(self.latent, workspace=workspace, start_image=self.pixels,
                                          positive=self.positive).result[0]
        return plan, time.perf_counter() - t0

    def patched(self, plan, fr_share=None, compile_models=False, verify=None, backend="auto", tail=True,
                guidance=False) -> tuple:
        """The experts as a user's graph gives them to the sampler: through ``TorchCompileModel`` if
        ``compile_models``, then (with a ``plan``) ``ChorusSparseSampler``, ``ChorusFeatureReuse`` and
        ``ChorusGuidanceBoost`` as asked; in context windows with ``--windows``."""
        from chorus.nodes.feature_reuse import ChorusFeatureReuse
        from chorus.nodes.guidance_boost import ChorusGuidanceBoost
        from chorus.nodes.sparse_sampler import ChorusSparseSampler

        models = []
        for m in self.experts:
            if compile_models:
                m = torch_compile_model(m, guard_filter=self.args.guard_filter)
                self.results["compile_guard_filter"] = host_compiles_with_guard_filter(m)
            if plan is not None:
                options = {"backend": backend}
                if not tail:
                    options["pooled_tail"] = False
                if verify is not None:
                    options["verify_threshold"] = verify
                m = ChorusSparseSampler.execute(m, plan, **options).result[0]
                if fr_share is not None:
                    m = ChorusFeatureReuse.execute(m, plan, downsample_share=fr_share).result[0]
                if guidance:
                    m = ChorusGuidanceBoost.execute(m, plan).result[0]
            models.append(m)
        return self.windowed(models)

    def sample(self, models, end_step=None):
        return sample_request(self.workflow, models, self.latent, self.positive, self.negative, 11, end_step=end_step)

    # -- timing -------------------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed_request(self, models, plan, compiled):
        """One timed request of ``models``: ``(output, seconds, the GPU's sampler window, the
        attention timer or None)``. Eager rows time each self-attention call through an outermost
        override; under compile that override would be traced into the graph, so compiled Chorus rows
        time the op from the inside."""
        cuda = self.device.type == "cuda"
        op_timer = OpTimer() if compiled and plan is not None and cuda else None
        timed_models, timer = (models, None) if compiled else with_timer(models)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with self.sampler.window() as gpu_window, (op_timer or contextlib.nullcontext()):
            out = self.sample(timed_models)
            self.synchronize()
        return out, time.perf_counter() - t0, gpu_window, timer or op_timer

    def timed(self, name, models, plan=None, again=None, profile_models=None):
        """One row: a warm-up, then one timed request. ``again()`` (compiled rows): the
        ``(models, plan)`` of a further request, after a whole first request as the warm-up (both
        experts compile in it: its time is ``first_request_s``); the timed request is the first of up
        to ``1 + STEADY_RETRIES`` such requests in which dynamo compiled nothing (ComfyUI's loading
        may change what the graph guards between requests); those that compiled are in
        ``unsteady_requests``; ``dynamo`` (:func:`compiling.dynamo_summary`): what dynamo compiled in the row's
        requests, counted since the caller cleared its counters. ``profile_models()`` (with ``--profile``): the
        models the profiled step runs, when not the row's own; a compiled row's profiled step comes after its
        ``dynamo`` is counted, and what it compiled (its one step's sigma schedule is shorter than a request's,
        which dynamo guards) is its own ``profile_step_frames_compiled``. Returns the request's output, or None
        past ``--time-budget``."""
        from chorus.nodes.comfy_patch import get_patch

        args, cuda = self.args, self.device.type == "cuda"
        if time.perf_counter() - self.t_start > args.time_budget:
            print(f"skipping {self.weights}/{self.res}/{name}: past the time budget", flush=True)
            return None
        compiled = again is not None
        first_request_s = compile_log = None
        with RecompileLog() if compiled else contextlib.nullcontext() as recompiles:
            if compiled:
                self.synchronize()
                t0 = time.perf_counter()
                with CompileLog() as compile_log:
                    self.sample(models)
                    self.synchronize()
                first_request_s = time.perf_counter() - t0
            else:
                self.sample(models, end_step=1)  # warm-up step
            unsteady, tries = [], 1 + STEADY_RETRIES if compiled else 1
            for attempt in range(tries):
                if compiled:
                    models, plan = again()
                frames_before = compiled_frames()
                out, seconds, gpu_window, timer = self.timed_request(models, plan, compiled)
                frames_compiled = compiled_frames() - frames_before
                if not frames_compiled or attempt == tries - 1:
                    break
                unsteady.append({"seconds": seconds, "frames_compiled": frames_compiled})
        per_call = timer.per_call_ms() if cuda and timer is not None else []
        grid = self.grid
        row = {"weights": self.weights, "res": self.res, "variant": name, "tokens": grid[0] * grid[1] * grid[2],
               "seconds": seconds, **attention_call_fields(per_call),
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               "finite": bool(torch.isfinite(out["samples"]).all()),
               "first_request_s": first_request_s, "gpu": gpu_window.summary(),
               "comfy_loading": loading_state(models)}
        if compiled:
            row["first_request_compile"] = compile_log.summary()
            row.update(unsteady_requests=unsteady, timed_request_frames_compiled=frames_compiled,
                       dynamo=dynamo_summary(recompiles))
        if plan is not None:
            row.update(plan_fields(plan))
        if name.split("+")[0] in GUIDED_VARIANTS:  # the timed request's models (eager: the warm-up step too)
            boosts = [get_patch(m).guidance for m in models]
            row["guidance"] = {"biased_calls": sum(b.biased_calls for b in boosts),
                               "boosted_forwards": sum(b.boosted_calls for b in boosts)}
        if args.profile:
            # the eager miss profiles a throwaway miss (one more step would record into the entry it is
            # about to write); a compiled row profiles its second request's models once more
            profiled = models if profile_models is None else profile_models()
            frames_before = compiled_frames()
            row["profile_step0"] = profile_step(lambda: self.sample(profiled, end_step=1))
            row["attn_kernels_ms_per_call"] = attention_kernels_ms(row["profile_step0"])
            if compiled:  # a one-step request has a shorter sigma schedule: dynamo may compile for it
                row["profile_step_frames_compiled"] = compiled_frames() - frames_before
        self.results["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile_step0"}), flush=True)
        save(self.results, args.out)
        return out

    def add_kernel_alone(self, plan, backend: str = "auto", portable_parts: bool = True) -> None:
        """The last row's ``kernel_alone_ms`` (a hit 15% row on a GPU: :func:`kernel_alone.kernel_alone_ms`)."""
        if self.device.type == "cuda":
            self.results["runs"][-1]["kernel_alone_ms"] = kernel_alone_ms(plan, self.shape, self.sampler,
                                                                          backend=backend,
                                                                          portable_parts=portable_parts)

    def skipped_row(self, name, why) -> None:
        """A row that could not run here: recorded with the reason, and the run goes on."""
        self.results["runs"].append({"weights": self.weights, "res": self.res, "variant": name, "skipped": str(why)})
        print(f"skipping {self.weights}/{self.res}/{name}: {why}", flush=True)

    # -- the rows -----------------------------------------------------------------------------------------------

    def dense_rows(self) -> None:
        """``dense`` (and its compiled twin), ``dense_rowmajor``, ``dense_cudnn`` and ``dense_ck``, as asked."""
        args, experts = self.args, self.experts
        if "dense" in args.variants:
            if not args.compiled_only:
                self.timed("dense", self.windowed(experts))
            if self.compiling:
                self.timed_compiled("dense")
        if args.compiled_only:
            return
        if "dense_rowmajor" in args.variants:
            self.timed("dense_rowmajor", self.windowed(row_major_models(experts)))
        if "dense_cudnn" in args.variants:
            try:
                with sdpa_cudnn_first():
                    self.timed("dense_cudnn", self.windowed(experts))
                    if self.results["runs"] and self.results["runs"][-1]["variant"] == "dense_cudnn":
                        self.results["runs"][-1]["sdpa_order"] = sdpa_order()
            except RuntimeError as exc:
                self.skipped_row("dense_cudnn", exc)
        if "dense_ck" in args.variants:
            try:
                ck_models = comfy_kitchen_attention_models(experts)
            except RuntimeError as exc:
                self.skipped_row("dense_ck", exc)
            else:
                self.timed("dense_ck", self.windowed(ck_models))

    def sol_row(self, name, start_percent) -> None:
        """A row of ComfyUI's core sparse attention on both experts (``sol_peer.py``); without
        ``comfy_kitchen`` the row records why it did not run."""
        from .sol_peer import CORE_NODE_DEFAULTS, sol_patched

        options = dict(CORE_NODE_DEFAULTS, start_percent=start_percent)
        if self.device.type == "cpu":  # toy sizes on the CPU: sol_attn's eager reference, no token threshold
            options.update(min_tokens=0, cuda_only=False)
        try:
            patched_pair = [sol_patched(m, **options) for m in self.experts]
            patched_pair = list(zip(self.windowed([m for m, _ in patched_pair]), [c for _, c in patched_pair]))
        except ImportError as exc:
            self.skipped_row(name, exc)
            return
        if self.timed(name, tuple(m for m, _ in patched_pair)) is not None:
            self.results["runs"][-1].update(
                sol_options={k: v for k, v in options.items() if k != "cuda_only"},
                sol_sparse_calls=sum(c.sparse_calls for _, c in patched_pair),
                sol_dense_calls=sum(c.dense_calls for _, c in patched_pair),
                sol_dense_reasons=[c.dense_reasons for _, c in patched_pair])

    def miss_row(self):
        """The miss on an empty workspace, then ``ChorusCacheWrite``: the plan whose entry the hits copy, or None
        where it wrote none (or the row did not run)."""
        from chorus.nodes.cache_write import ChorusCacheWrite

        args = self.args
        plan, t_ret = self.retrieve(self.ws_miss)
        assert not plan.is_hit, plan.message
        sampled = self.timed("miss", self.patched(plan, fr_share=args.fr_share), plan,
                             profile_models=lambda: self.patched(self.retrieve(f"{self.ws_miss}_profile")[0],
                                                                 fr_share=args.fr_share))
        if sampled is None:
            return None
        t0 = time.perf_counter()
        info = ChorusCacheWrite.execute(self.latent, plan).result[0]
        t_write = time.perf_counter() - t0
        self.results["runs"][-1].update(retrieve_s=t_ret, write_s=t_write, write=info[:200])
        if not info.startswith("wrote entry"):
            print(f"the miss wrote no entry: {info}", flush=True)
            return None
        return plan

    def hit_workspace(self, name, entry_plan) -> str:
        """The workspace of hit ``name``: the miss's entry with its maps replaced by structured maps of the hit's
        density (written once per density and order)."""
        from chorus.cache_store import Workspace, resolve_workspace
        from chorus.engine.compat import entry_token_order

        density = HIT_DENSITY[name]
        hit_ws = f"{self.ws_hit}_{int(density * 100)}" + ("_raster" if name in RASTER_VARIANTS else "")
        ws = Workspace.open(resolve_workspace(hit_ws))
        if len(ws) == 0:
            src = Workspace.open(resolve_workspace(self.ws_miss))
            eid = src.search(entry_plan.embedding, k=1)[0][0]
            masks, meta = src.load(eid, packed=True, touch=False)
            meta = dict(meta, signature=dict(meta["signature"]))
            if name in RASTER_VARIANTS:
                meta["signature"]["token_order"] = "thw"
            order = entry_token_order(meta["signature"])
            entry_grid = tuple(meta["signature"]["token_grid"])  # the first window's with --windows
            per_layer = structured_maps(entry_grid, self.shape["num_heads"], density, self.shape["num_layers"],
                                        self.device, order)
            ws.add(entry_plan.embedding, {key: per_layer[key[2]] for key in masks}, meta)
            self.results.setdefault("entry_orders", {})[hit_ws] = meta["signature"].get("token_order")
        return hit_ws

    def hit_rows(self, name, entry_plan) -> None:
        """Hit ``name``: once per named ``--hit-backends`` backend (hit15 / hit5), the plain (``auto``) row, and
        its compiled twin; with ``--compiled-only`` the compiled row alone."""
        args = self.args
        hit_ws = self.hit_workspace(name, entry_plan)
        if args.compiled_only:
            if self.compiling and name in COMPILED_HITS:
                self.timed_compiled(name)
            return
        per_backend = name in ("hit15", "hit5")
        for backend in [b for b in args.hit_backends if b != "auto"] if per_backend else []:
            plan_b, _ = self.retrieve(hit_ws)
            if self.timed(f"{name}@{backend}", self.patched(plan_b, backend=backend), plan_b) is not None:
                self.results["runs"][-1]["backend"] = backend
                if name == "hit15":
                    self.add_kernel_alone(plan_b, backend)
        if per_backend and "auto" not in args.hit_backends:
            return  # the plain (auto) row runs only when asked for
        plan, t_ret = self.retrieve(hit_ws)
        assert plan.is_hit, plan.message
        models = self.patched(plan, fr_share=args.fr_share if name in FEATURE_REUSE_VARIANTS else None,
                              verify=VERIFY_THRESHOLD_PASSING if name == "hitver" else None,
                              tail=name not in NO_TAIL_VARIANTS, guidance=name in GUIDED_VARIANTS)
        if self.timed(name, models, plan) is None:
            return
        self.results["runs"][-1].update(retrieve_s=t_ret)
        if name == "hitver":
            self.results["runs"][-1]["verification"] = {str(e): dict(v) for e, v in plan.stats.verification.items()}
        if name == "hit15":
            self.add_kernel_alone(plan)
        if self.compiling and name in COMPILED_HITS:
            self.timed_compiled(name)

    # -- compiled rows ------------------------------------------------------------------------------------------

    def compiled_request(self, variant):
        """``(models, plan)`` of one compiled request of ``variant`` (a new plan each time: a miss
        on a workspace of its own that nothing is written to, a hit retrieved again)."""
        args = self.args
        if variant == "dense":
            return self.patched(None, compile_models=True), None
        if variant == "miss":
            plan = self.retrieve(f"{self.ws_miss}_compiled_{next(self.fresh)}")[0]
            return self.patched(plan, fr_share=args.fr_share, compile_models=True), plan
        plan = self.retrieve(f"{self.ws_hit}_{int(HIT_DENSITY[variant] * 100)}")[0]
        assert plan.is_hit, plan.message
        share = args.fr_share if variant in FEATURE_REUSE_VARIANTS else None
        return self.patched(plan, fr_share=share, compile_models=True, tail=variant not in NO_TAIL_VARIANTS,
                            guidance=variant in GUIDED_VARIANTS), plan

    def timed_compiled(self, variant):
        """A compiled row in a fresh dynamo state: each variant's graphs, not what earlier rows left
        (dynamo's recompile limit, 8 per code object, is shared by everything one process compiles).
        ``dynamo``: unique graphs, graph breaks and frames compiled (recompiles included) in this row's
        requests (:meth:`timed`; not its profiled step's). A row that raises is recorded as ``failed`` (module
        docstring); None then."""
        from torch._dynamo.utils import counters

        from chorus.engine.state import failure_text

        torch._dynamo.reset()
        counters.clear()
        models, plan = self.compiled_request(variant)
        try:
            out = self.timed(f"{variant}+compile", models, plan, again=lambda: self.compiled_request(variant))
        except Exception as exc:  # noqa: BLE001 - what the host's compile cannot run is the row's result
            failed = failure_text(exc)
            self.results["runs"].append({"weights": self.weights, "res": self.res, "variant": f"{variant}+compile",
                                         "failed": failed})
            print(f"{self.weights}/{self.res}/{variant}+compile failed: {failed}", flush=True)
            save(self.results, self.args.out)
            return None
        if out is not None and variant == "hit15":  # the portable kernel's parts: timed by the eager row where it ran
            self.add_kernel_alone(plan, portable_parts=self.args.compiled_only)
            save(self.results, self.args.out)
        return out


def gpu_sampler(device):
    """The GPU's SM clock, power and clock-limit reasons sampled every 50 ms while a window is open
    (``benchmarks/kernels/gpu_state.py``; NVML); on the CPU, or without NVML, windows report
    ``available: False``."""
    from ..kernels.gpu_state import GpuSampler

    return GpuSampler(index=device.index or 0, interval_s=0.05,
                      off_reason="" if device.type == "cuda" else "a CPU run")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", help="ComfyUI checkout (default: $COMFYUI_DIR)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="a14b", choices=sorted(WORKFLOWS),
                   help="the workflow whose request runs: " + "; ".join(f"{k}: {w.label}" for k, w in WORKFLOWS.items()))
    p.add_argument("--res", nargs="+", default=None,
                   help="resolutions (default: the model's own but 'tiny'; a14b: 480p 720p, ti2v5b: 720p = 1280 x 704)")
    p.add_argument("--weights", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp8", "fp8_scaled"])
    p.add_argument("--variants", nargs="+", default=["dense", "miss", "hit15", "hit5", "hitfr"],
                   choices=["dense", "dense_rowmajor", "dense_cudnn", "dense_ck", "miss", *HIT_VARIANTS,
                            *SOL_VARIANTS])
    p.add_argument("--hit-backends", nargs="+", default=["auto"],
                   help="sparse-attention backends the hit15 / hit5 variants run with (rows 'hit15@NAME'; "
                        "'auto' = the node's default row 'hit15')")
    p.add_argument("--compile", action="store_true",
                   help="also dense, miss, hit15, hit15_notail, hitfr and hitfr_gb (those asked for) under "
                        "TorchCompileModel")
    p.add_argument("--compile-res", nargs="+", default=["480p", "720p", "tiny"], help="resolutions --compile applies to")
    p.add_argument("--guard-filter", action="store_true",
                   help="with --compile: compile as later ComfyUI's TorchCompileModel does by default (no dynamo "
                        "guard on transformer_options) where the host's node does not (0.3.64)")
    p.add_argument("--compiled-only", action="store_true",
                   help="with --compile: only the compiled rows, each beside compiled dense (the eager miss still "
                        "runs when a hit variant needs its entry)")
    p.add_argument("--layers", type=int, default=0, help="layers per expert (default: the model's, 40 or 30)")
    p.add_argument("--tiny", action="store_true", help="toy sizes and at most 4 steps, on the CPU (tests)")
    p.add_argument("--time-budget", type=float, default=1e9, help="seconds; later variants are skipped past it")
    p.add_argument("--profile", action="store_true",
                   help="also one step of each variant under torch.profiler: its top kernels by GPU time")
    p.add_argument("--fr-share", type=float, default=0.25,
                   help="ChorusFeatureReuse downsample_share of the miss and the hitfr rows (the node's default 0.25)")
    p.add_argument("--frames", type=int, default=None,
                   help="pixel frames of the request (4n + 1; default: the resolution's, 81 or 121)")
    p.add_argument("--windows", type=int, nargs=2, default=None, metavar=("LENGTH", "OVERLAP"),
                   help="every row's models in the core 'WAN Context Windows (Manual)' node: windows of LENGTH pixel "
                        "frames overlapping by OVERLAP (ComfyUI >= 0.28.2, whose Wan node runs them with its causal "
                        "window fix); with --frames longer than a window")
    p.add_argument("--window-schedule", default="standard_static", choices=WINDOW_SCHEDULES,
                   help="with --windows: the node's context_schedule (standard_uniform is its default from 0.28.2 on)")
    p.add_argument("--end-image", action="store_true",
                   help="condition as WanFirstLastFrameToVideo (a start and an end image; Wan I2V models only): "
                        "the entries record and the hits check image frames [1, 1, 0]")
    args = p.parse_args(argv)
    if args.end_image and not WORKFLOWS[args.model].image_in_channels:
        p.error(f"--end-image needs a Wan I2V model (--model {args.model} takes its image in the latent)")
    if args.compiled_only and not args.compile:
        p.error("--compiled-only needs --compile")
    if args.guard_filter and not args.compile:
        p.error("--guard-filter needs --compile")
    if args.frames is not None and (args.frames < 1 or args.frames % 4 != 1):
        p.error(f"--frames must be 4n + 1, got {args.frames}")
    resolutions = WORKFLOWS[args.model].resolutions
    if args.tiny:
        args.res = ["tiny"]
    elif args.res is None:
        args.res = [r for r in resolutions if r != "tiny"]
    unknown = [r for r in args.res if r not in resolutions]
    if unknown:
        p.error(f"--model {args.model} runs at {', '.join(resolutions)}; got {', '.join(unknown)}")
    results = run(args)
    save(results, args.out)
    print(table(results))
    if "compile_guard_filter" in results:
        print(f"compiled rows: {'with' if results['compile_guard_filter'] else 'without'} later ComfyUI's guard filter "
              "(no dynamo guard on transformer_options)")
    if "windows" in results:
        w = results["windows"]
        print(f"context windows of {w['context_length']} frames, overlap {w['context_overlap']}: latent frames "
              + ", ".join(f"{ws[0]}-{ws[-1]}" for ws in w["windows"]) + f" of {w['latent_frames']}")
    print(f"wall {results['wall_s']:.1f} s")
    failed = [r["variant"] for r in results["runs"] if "failed" in r]
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
