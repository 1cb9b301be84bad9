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
  older order, on any host: :func:`sdpa_cudnn_first`); ``dense_ck`` (the models through ComfyUI's core "Model
  Attention Backend" node at "comfy kitchen attention", 0.33.0 and 0.38.x: comfy-kitchen's dense INT8 attention
  in every attention call, what ComfyUI's ``--use-ck-attention`` makes global; skipped with the reason where the
  host has no such node or comfy-kitchen no INT8 kernel for the device: :func:`comfy_kitchen_attention_models`);
  ``dense_rowmajor`` (the same, each block on a row-major copy of its input, as Chorus's block patch runs every
  block of a patched model: ComfyUI hands them the patch embedding's transposed view, which Wan 2.2 TI2V 5B's
  per-token modulation makes costly; :func:`row_major_models`);
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
  FP8-scaled linears do under torch 2.11: docs/BENCHMARKS.md, run 120) is a row with ``failed`` (the error's first
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
  its clock in ``gpu_auto_under_load``). A compiled hit 15% row times the kernel alone too. Retrieval and
  cache-write times are reported separately (they run on the CPU before / after sampling). ``comfy_loading``:
  whether ComfyUI loaded both experts whole for the timed request (:func:`loading_state`; two bf16 A14B experts
  take 53 GiB, so on an 80 GB card it may load them partially, and the table marks such a row).

Writes ``OUT/comfy_e2e.json`` (every number) and prints a table. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .compiling import (STEADY_RETRIES, CompileLog, RecompileLog, compiled_frames, host_compiles_with_guard_filter,
                        torch_compile_model)
from .timers import OpTimer, with_timer

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


def host_runs_i2v_in_windows() -> bool:
    """Whether this ComfyUI samples a Wan I2V model in context windows: from 0.28.2 (its context handler cuts
    the image conditioning to each window and has the causal window fix, which the Wan node turns on); 0.3.64
    leaves the conditioning whole."""
    import inspect

    from comfy.context_windows import IndexListContextHandler

    return "causal_window_fix" in inspect.signature(IndexListContextHandler.__init__).parameters


WINDOW_SCHEDULES = ("standard_static", "standard_uniform", "looped_uniform", "batched")


def context_windows(model, length: int, overlap: int, schedule: str = "standard_static"):
    """``model`` through the core "WAN Context Windows (Manual)" node as a user's graph runs it: windows of
    ``length`` pixel frames overlapping by ``overlap`` in ``schedule`` (one of :data:`WINDOW_SCHEDULES`; the
    node's default from 0.28.2 on is ``standard_uniform``, whose windows move from step to step), the node's
    defaults otherwise (stride 1, no loop, ``pyramid`` fusing, FreeNoise on, and the host's causal window fix,
    which its Wan node turns on)."""
    import inspect

    from comfy_extras.nodes_context_windows import WanContextWindowsManualNode

    inputs = dict(context_length=length, context_overlap=overlap, context_schedule=schedule,
                  context_stride=1, closed_loop=False, fuse_method="pyramid")
    if "freenoise" in inspect.signature(WanContextWindowsManualNode.execute).parameters:
        inputs["freenoise"] = True
    return WanContextWindowsManualNode.execute(model, **inputs).result[0]


def windows_of(model, frames: int) -> list[list[int]]:
    """The latent frames of each context window ``model``'s handler runs on a latent of ``frames`` latent frames
    (at the first step: a uniform schedule moves them at later steps)."""
    handler = model.model_options["context_handler"]
    return [list(w) for w in handler.context_schedule.func(frames, handler, {})]


def import_comfy(comfy_dir: Path, cpu: bool):
    """Import ComfyUI from a checkout (a benchmark, not the pack: the checkout goes on sys.path). On the CPU the
    models attend with ``attention_pytorch`` (SDPA, ComfyUI's ``--use-pytorch-cross-attention``), as ComfyUI
    attends on a GPU: its CPU default (``attention_sub_quad``) reads free memory in each call, a graph break in
    every compiled block."""
    if not (comfy_dir / "comfy" / "ldm" / "wan" / "model.py").is_file():
        raise SystemExit(f"error: {comfy_dir} is not a ComfyUI checkout")
    sys.path.insert(0, str(comfy_dir))
    import comfy.cli_args

    comfy.cli_args.args.cpu = cpu
    comfy.cli_args.args.use_pytorch_cross_attention = comfy.cli_args.args.use_pytorch_cross_attention or cpu
    comfy.cli_args.args.highvram = not cpu  # keep both experts resident, as a 141 GB card does
    import comfy.model_management  # noqa: F401
    import comfy.model_patcher  # noqa: F401
    import nodes  # noqa: F401  (ComfyUI's nodes.py: KSamplerAdvanced)
    return comfy


class FastFp8:
    """``--fast fp8_matrix_mult`` while ComfyUI picks the operations of a model (restored after)."""

    def __enter__(self):
        import comfy.cli_args as cli

        self.cli = cli
        self.before = set(cli.args.fast or ())
        cli.args.fast = self.before | {cli.PerformanceFeature.Fp8MatrixMultiplication}

    def __exit__(self, *exc):
        self.cli.args.fast = self.before


def build_expert(shape: dict, weights: str, seed: int, device: torch.device):
    """A ComfyUI ``ModelPatcher`` over a random Wan expert built by ComfyUI's own loader path."""
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ldm.wan.model
    import comfy.ops

    with torch.device("meta"):
        meta = comfy.ldm.wan.model.WanModel(model_type="t2v", operations=comfy.ops.disable_weight_init, **shape)
    sd = dict(meta.state_dict())
    config = comfy.model_detection.model_config_from_unet(sd, "")
    if config is None:
        raise RuntimeError("ComfyUI did not detect the Wan state dict")
    if weights == "fp8_scaled":
        return _fp8_scaled_expert(sd, seed, device)
    if weights == "fp8":
        unet_dtype = torch.float8_e4m3fn
        config.optimizations["fp8"] = True
    elif weights == "fp16":
        unet_dtype = torch.float16  # on the CPU too (toy sizes): the fp16 path itself is what these rows are for
    else:
        unet_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    manual_cast = comfy.model_management.unet_manual_cast(unet_dtype, device, config.supported_inference_dtypes)
    config.set_inference_dtype(unet_dtype, manual_cast)
    if weights == "fp8":
        with FastFp8():
            model = config.get_model({}, "", device=device)
    else:
        model = config.get_model({}, "", device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.diffusion_model.named_parameters():
            p.copy_(random_weight(name, p.shape, device, gen))
    # ComfyUI 0.3.64 never leaves training mode for the diffusion model, and its fp8_ops.Linear runs the FP8
    # matmul only outside training mode (later ComfyUI versions dropped that condition): in training mode
    # the FP8-weights path casts each weight back to bf16 (measured: fp8_linears.py and BENCHMARKS.md)
    model.diffusion_model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
    return patcher, linear_ops(model.diffusion_model)


def random_weight(name: str, shape, device, gen: torch.Generator) -> torch.Tensor:
    """The benchmark's random value of one Wan parameter, float32 on ``device``: biases 0, norm scales 1, every
    other tensor N(0, 0.02^2) drawn from ``gen``."""
    if name.endswith("bias"):
        return torch.zeros(shape, device=device)
    if "norm" in name and len(shape) == 1:
        return torch.ones(shape, device=device)
    return torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * 0.02


def _fp8_scaled_expert(meta_state_dict: dict, seed: int, device: torch.device):
    """``build_expert`` for ``--weights fp8_scaled``: random weights (:func:`random_weight`) in the layout
    of ComfyUI's FP8-scaled Wan files (``fp8_scaled.py``), made one tensor at a time on ``device`` and loaded by
    ComfyUI's own ``load_diffusion_model_state_dict`` (what UNETLoader runs on such a file, ``weight_dtype``
    default), kept on ``device`` where the host lets the caller name the offload device (0.28.2 on)."""
    import comfy.sd

    from .fp8_scaled import fp8_scaled_state_dict

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = ((name, random_weight(name, p.shape, device, gen)) for name, p in meta_state_dict.items())
    patcher = comfy.sd.load_diffusion_model_state_dict(fp8_scaled_state_dict(weights),
                                                        model_options={"offload_device": device})
    if patcher is None:
        raise RuntimeError("ComfyUI did not detect the FP8-scaled Wan state dict")
    patcher.model.diffusion_model.eval()  # as build_expert: 0.3.64 leaves the model in training mode
    return patcher, linear_ops(patcher.model.diffusion_model)


def linear_ops(diffusion_model) -> str:
    """The operations ComfyUI gave a Wan model's linears, as the JSON's ``ops`` names them: the first self-attention
    q projection's class and its weight's type and dtype (``QuantizedTensor``, e4m3, fp16 ...)."""
    q = diffusion_model.blocks[0].self_attn.q
    return type(q).__module__ + "." + type(q).__qualname__ + f" ({type(q.weight).__name__} {q.weight.dtype})"


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


def loading_state(models) -> list[dict]:
    """How ComfyUI loaded each expert's weights for the request just run (``ModelPatcher.loaded_size`` /
    ``model_size``, GiB, and whether it loaded it partially, ``model_lowvram``): a GPU too small for both experts
    and the request makes ComfyUI load them partially, and its ops then cast weights per call (slower, and
    under compile another graph); a row where that happened measures ComfyUI's loading, not attention."""
    return [{"loaded_gib": round(m.loaded_size() / 2 ** 30, 2), "size_gib": round(m.model_size() / 2 ** 30, 2),
             "partial": bool(getattr(m.model, "model_lowvram", False))} for m in models]


def sdpa_order() -> list[str] | None:
    """The host's SDPA backend order (``comfy.ops.SDPA_BACKEND_PRIORITY``), or None where it sets none."""
    import comfy.ops

    order = getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", None)
    return None if order is None else [backend.name for backend in order]


@contextlib.contextmanager
def sdpa_cudnn_first():
    """The ``dense_cudnn`` row: the host's SDPA backend order with cuDNN attention first and the others in the
    host's order (0.3.64 and 0.28.2 put it first, 0.33.0 and 0.38.x second after flash), restored after. A
    benchmark's reference row: it reorders ComfyUI's module-level order list in place, which its SDPA wrapper
    reads at every call. Raises ``RuntimeError`` where the host sets no order or has no cuDNN entry in it."""
    import comfy.ops
    from torch.nn.attention import SDPBackend

    order = getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", None)
    if order is None or SDPBackend.CUDNN_ATTENTION not in order:
        raise RuntimeError("this ComfyUI sets no SDPA backend order with cuDNN attention in it")
    before = list(order)
    order.sort(key=lambda backend: backend != SDPBackend.CUDNN_ATTENTION)  # stable: the rest keep their order
    try:
        yield
    finally:
        order[:] = before


def comfy_kitchen_attention_models(models):
    """The ``dense_ck`` row's models: each through ComfyUI's core "Model Attention Backend" node
    (``ModelAttentionBackend`` of ``comfy_extras/nodes_model_advanced.py``: a V1 node with ``patch`` in 0.33.0, a V3
    node with ``execute`` in 0.38.x; not in 0.3.64) at "comfy kitchen attention", which puts comfy-kitchen's INT8
    attention (``attention_comfy_kitchen_int8``, dense: INT8 Q.K and P.V) on the clone for every attention call.
    Raises ``RuntimeError`` where the host has no such node, or where comfy-kitchen has no INT8 attention kernel
    for this device (the node itself would fall back to PyTorch's attention with a warning: a row of that would be
    a second dense row under another name)."""
    try:
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend
    except ImportError as exc:
        raise RuntimeError(f"this ComfyUI has no Model Attention Backend node ({exc})") from None
    import comfy.ldm.modules.attention as attention

    if not getattr(attention, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False):
        raise RuntimeError("comfy-kitchen has no INT8 attention kernel for this device (its is_available() is False)")
    if hasattr(ModelAttentionBackend, "define_schema"):  # the V3 node
        return tuple(ModelAttentionBackend.execute(model, "comfy kitchen attention").result[0] for model in models)
    return tuple(ModelAttentionBackend().patch(model, "comfy kitchen attention")[0] for model in models)


def row_major_block(args, extra):
    """A Wan block patch that runs the block on a row-major copy of its input, as Chorus's block patch does
    (``nodes/comfy_forward.ChorusBlock``): ComfyUI hands the blocks the patch embedding's transposed view, and
    its elementwise ops and layer norms run strided on it."""
    x = args["img"]
    return extra["original_block"](dict(args, img=x.contiguous()) if not x.is_contiguous() else args)


def row_major_models(models):
    """Clones of ``models`` whose every block runs through :func:`row_major_block`: dense attention with the
    residual stream Chorus's patch gives every forward, to tell that part of a Chorus row's time from its
    attention's (the ``dense_rowmajor`` row)."""
    out = []
    for model in models:
        clone = model.clone()
        for layer in range(len(clone.model.diffusion_model.blocks)):
            clone.set_model_patch_replace(row_major_block, "dit", "double_block", layer)
        out.append(clone)
    return tuple(out)


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
    cpu = args.tiny or not torch.cuda.is_available()
    comfy_dir = Path(args.comfyui or os.environ.get("COMFYUI_DIR", ""))
    import_comfy(comfy_dir, cpu)
    if args.windows and not host_runs_i2v_in_windows():
        raise SystemExit("--windows needs ComfyUI 0.28.2 or later: this one samples no Wan I2V model in context "
                         "windows")
    device = torch.device("cpu" if cpu else "cuda")
    root = Path(tempfile.mkdtemp(prefix="chorus_comfy_e2e_"))
    os.environ["CHORUS_CACHE_DIR"] = str(root)
    from chorus import kernels
    from chorus.cache_store import Workspace, resolve_workspace
    from chorus.engine import token_grid
    from chorus.engine.compat import entry_token_order
    from chorus.engine.state import failure_text
    from chorus.nodes.cache_write import ChorusCacheWrite
    from chorus.nodes.comfy_patch import get_patch
    from chorus.nodes.feature_reuse import ChorusFeatureReuse
    from chorus.nodes.guidance_boost import ChorusGuidanceBoost
    from chorus.nodes.host_report import comfyui_version
    from chorus.nodes.mask_retrieve import ChorusMaskRetrieve
    from chorus.nodes.sparse_sampler import ChorusSparseSampler

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
            lat_shape = workflow.latent_shape(res, args.frames)
            grid = token_grid(lat_shape)
            positive, negative, latent = conditioning(workflow, lat_shape, 7, end_image=args.end_image)
            pixels = start_image_pixels(workflow, res, 3)
            ws_miss, ws_hit = f"bench_{weights}_{res}_miss", f"bench_{weights}_{res}_hit"

            def windowed(models):
                """``models`` in context windows with ``--windows``, else as they are."""
                if not args.windows:
                    return tuple(models)
                wrapped = tuple(context_windows(m, *args.windows, args.window_schedule) for m in models)
                results["windows"] = {"context_length": args.windows[0], "context_overlap": args.windows[1],
                                      "context_schedule": args.window_schedule,
                                      "latent_frames": lat_shape[2],
                                      "windows": windows_of(wrapped[0], lat_shape[2])}
                return wrapped

            def retrieve(workspace):
                t0 = time.perf_counter()
                plan = ChorusMaskRetrieve.execute(latent, workspace=workspace, start_image=pixels,
                                                  positive=positive).result[0]
                return plan, time.perf_counter() - t0

            def patched(plan, fr_share=None, compile_models=False, verify=None, backend="auto", tail=True,
                        guidance=False):
                models = []
                for m in experts:
                    if compile_models:
                        m = torch_compile_model(m, guard_filter=args.guard_filter)
                        results["compile_guard_filter"] = host_compiles_with_guard_filter(m)
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
                return windowed(models)

            def timed_request(models, plan, compiled):
                """One timed request of ``models``: ``(output, seconds, the GPU's sampler window, the
                attention timer or None)``. Eager rows time each self-attention call through an outermost
                override; under compile that override would be traced into the graph, so compiled Chorus rows
                time the op from the inside."""
                op_timer = OpTimer() if compiled and plan is not None and device.type == "cuda" else None
                timed_models, timer = (models, None) if compiled else with_timer(models)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with sampler.window() as gpu_window, (op_timer or contextlib.nullcontext()):
                    out = sample_request(workflow, timed_models, latent, positive, negative, 11)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                return out, time.perf_counter() - t0, gpu_window, timer or op_timer

            def timed(name, models, plan=None, again=None, profile_models=None):
                """One row: a warm-up, then one timed request. ``again()`` (compiled rows): the
                ``(models, plan)`` of a further request, after a whole first request as the warm-up (both
                experts compile in it: its time is ``first_request_s``); the timed request is the first of up
                to ``1 + STEADY_RETRIES`` such requests in which dynamo compiled nothing (ComfyUI's loading
                may change what the graph guards between requests); those that compiled are in
                ``unsteady_requests``. ``profile_models()`` (with ``--profile``): the models the profiled step
                runs, when not the row's own."""
                if time.perf_counter() - t_start > args.time_budget:
                    print(f"skipping {weights}/{res}/{name}: past the time budget", flush=True)
                    return None
                compiled = again is not None
                first_request_s = compile_log = None
                if compiled:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with CompileLog() as compile_log:
                        sample_request(workflow, models, latent, positive, negative, 11)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                    first_request_s = time.perf_counter() - t0
                else:
                    sample_request(workflow, models, latent, positive, negative, 11, end_step=1)  # warm-up step
                unsteady, tries = [], 1 + STEADY_RETRIES if compiled else 1
                for attempt in range(tries):
                    if compiled:
                        models, plan = again()
                    frames_before = compiled_frames()
                    out, seconds, gpu_window, timer = timed_request(models, plan, compiled)
                    frames_compiled = compiled_frames() - frames_before
                    if not frames_compiled or attempt == tries - 1:
                        break
                    unsteady.append({"seconds": seconds, "frames_compiled": frames_compiled})
                per_call = timer.per_call_ms() if device.type == "cuda" and timer is not None else []
                row = {"weights": weights, "res": res, "variant": name, "tokens": grid[0] * grid[1] * grid[2],
                       "seconds": seconds, "attn_ms_per_layer": float(np.mean(per_call)) if per_call else None,
                       "attn_ms_median": float(np.median(per_call)) if per_call else None,
                       "attn_ms_first_call": per_call[0] if per_call else None,
                       "attn_calls_timed": len(per_call),
                       "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                       "finite": bool(torch.isfinite(out["samples"]).all()),
                       "first_request_s": first_request_s, "gpu": gpu_window.summary(),
                       "comfy_loading": loading_state(models)}
                if compile_log is not None:
                    row["first_request_compile"] = compile_log.summary()
                    row.update(unsteady_requests=unsteady, timed_request_frames_compiled=frames_compiled)
                if plan is not None:
                    row.update(plan_kind=plan.kind, density=plan.stats.density, sparse_calls=plan.stats.sparse_calls,
                               blocks_computed=plan.stats.blocks_computed, blocks_total=plan.stats.blocks_total,
                               fallback_calls=plan.stats.fallback_calls, tail_calls=plan.stats.tail_calls,
                               messages=plan.stats.messages[:5],
                               fr_blocks_reduced=plan.state.feature_reuse.blocks_reduced,
                               fr_blocks_full=plan.state.feature_reuse.blocks_full,
                               image_frames=None if plan.state.image_frames is None else list(plan.state.image_frames))
                if name.split("+")[0] in GUIDED_VARIANTS:  # the timed request's models (eager: the warm-up step too)
                    boosts = [get_patch(m).guidance for m in models]
                    row["guidance"] = {"biased_calls": sum(b.biased_calls for b in boosts),
                                       "boosted_forwards": sum(b.boosted_calls for b in boosts)}
                if args.profile:
                    # the eager miss profiles a throwaway miss (one more step would record into the entry it is
                    # about to write); a compiled row profiles its second request's models once more
                    profiled = models if profile_models is None else profile_models()
                    row["profile_step0"] = profile_step(lambda: sample_request(workflow, profiled, latent, positive,
                                                                               negative, 11, end_step=1))
                    row["attn_kernels_ms_per_call"] = attention_kernels_ms(row["profile_step0"])
                results["runs"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profile_step0"}), flush=True)
                save(results, args.out)
                return out

            def skipped_row(name, why):
                """A row that could not run here: recorded with the reason, and the run goes on."""
                results["runs"].append({"weights": weights, "res": res, "variant": name, "skipped": str(why)})
                print(f"skipping {weights}/{res}/{name}: {why}", flush=True)

            def sol_row(name, start_percent):
                """A row of ComfyUI's core sparse attention on both experts (``sol_peer.py``); without
                ``comfy_kitchen`` the row records why it did not run."""
                from .sol_peer import CORE_NODE_DEFAULTS, sol_patched

                options = dict(CORE_NODE_DEFAULTS, start_percent=start_percent)
                if cpu:  # toy sizes on the CPU: sol_attn's eager reference, no token threshold
                    options.update(min_tokens=0, cuda_only=False)
                try:
                    patched_pair = [sol_patched(m, **options) for m in experts]
                    patched_pair = list(zip(windowed([m for m, _ in patched_pair]), [c for _, c in patched_pair]))
                except ImportError as exc:
                    skipped_row(name, exc)
                    return
                if timed(name, tuple(m for m, _ in patched_pair)) is not None:
                    results["runs"][-1].update(
                        sol_options={k: v for k, v in options.items() if k != "cuda_only"},
                        sol_sparse_calls=sum(c.sparse_calls for _, c in patched_pair),
                        sol_dense_calls=sum(c.dense_calls for _, c in patched_pair),
                        sol_dense_reasons=[c.dense_reasons for _, c in patched_pair])

            compiling = args.compile and res in args.compile_res
            fresh = iter(range(10 ** 6))

            def compiled_request(variant):
                """``(models, plan)`` of one compiled request of ``variant`` (a new plan each time: a miss
                on a workspace of its own that nothing is written to, a hit retrieved again)."""
                if variant == "dense":
                    return patched(None, compile_models=True), None
                if variant == "miss":
                    plan = retrieve(f"{ws_miss}_compiled_{next(fresh)}")[0]
                    return patched(plan, fr_share=args.fr_share, compile_models=True), plan
                plan = retrieve(f"{ws_hit}_{int(HIT_DENSITY[variant] * 100)}")[0]
                assert plan.is_hit, plan.message
                share = args.fr_share if variant in FEATURE_REUSE_VARIANTS else None
                return patched(plan, fr_share=share, compile_models=True, tail=variant not in NO_TAIL_VARIANTS,
                               guidance=variant in GUIDED_VARIANTS), plan

            def timed_compiled(variant):
                """A compiled row in a fresh dynamo state: each variant's graphs, not what earlier rows left
                (dynamo's recompile limit, 8 per code object, is shared by everything one process compiles).
                ``dynamo``: unique graphs, graph breaks and frames compiled (recompiles included) in this row's
                requests, and with ``--profile`` its profiled step too (whose forward adds its own host-side breaks).
                A row that raises is recorded as ``failed`` (module docstring); None then."""
                from torch._dynamo.utils import counters

                torch._dynamo.reset()
                counters.clear()
                models, plan = compiled_request(variant)
                try:
                    with RecompileLog() as recompiles:
                        out = timed(f"{variant}+compile", models, plan, again=lambda: compiled_request(variant))
                except Exception as exc:  # noqa: BLE001 - what the host's compile cannot run is the row's result
                    failed = failure_text(exc)
                    results["runs"].append({"weights": weights, "res": res, "variant": f"{variant}+compile",
                                            "failed": failed})
                    print(f"{weights}/{res}/{variant}+compile failed: {failed}", flush=True)
                    save(results, args.out)
                    return None
                if out is not None:
                    if variant == "hit15" and device.type == "cuda":
                        results["runs"][-1]["kernel_alone_ms"] = kernel_alone_ms(plan, plan.token_grid, shape,
                                                                                 kernels, sampler)
                    results["runs"][-1]["dynamo"] = {
                        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
                        "graph_breaks": int(sum(counters["graph_break"].values())),
                        "frames": {k: int(v) for k, v in counters["frames"].items()},  # every compile, recompiles too
                        "graph_break_reasons": sorted({r.splitlines()[0][:160] for r in counters["graph_break"]})[:8],
                        "recompiles": len(recompiles.reasons), "recompile_reasons": recompiles.summary()}
                    save(results, args.out)
                return out

            if "dense" in args.variants:
                if not args.compiled_only:
                    timed("dense", windowed(experts))
                if compiling:
                    timed_compiled("dense")
            if "dense_rowmajor" in args.variants and not args.compiled_only:
                timed("dense_rowmajor", windowed(row_major_models(experts)))
            if "dense_cudnn" in args.variants and not args.compiled_only:
                try:
                    with sdpa_cudnn_first():
                        timed("dense_cudnn", windowed(experts))
                        if results["runs"] and results["runs"][-1]["variant"] == "dense_cudnn":
                            results["runs"][-1]["sdpa_order"] = sdpa_order()
                except RuntimeError as exc:
                    skipped_row("dense_cudnn", exc)
            if "dense_ck" in args.variants and not args.compiled_only:
                try:
                    ck_models = comfy_kitchen_attention_models(experts)
                except RuntimeError as exc:
                    skipped_row("dense_ck", exc)
                else:
                    timed("dense_ck", windowed(ck_models))
            for name, start in SOL_VARIANTS.items():
                if name in args.variants:
                    sol_row(name, start)
            entry_plan = None
            needs_entry = any(v in args.variants for v in HIT_VARIANTS)
            if needs_entry or ("miss" in args.variants and not args.compiled_only):
                plan, t_ret = retrieve(ws_miss)
                assert not plan.is_hit, plan.message
                sampled = timed("miss", patched(plan, fr_share=args.fr_share), plan, profile_models=lambda: patched(
                    retrieve(f"{ws_miss}_profile")[0], fr_share=args.fr_share))
                if sampled is not None:
                    t0 = time.perf_counter()
                    info = ChorusCacheWrite.execute(latent, plan).result[0]
                    t_write = time.perf_counter() - t0
                    results["runs"][-1].update(retrieve_s=t_ret, write_s=t_write, write=info[:200])
                    entry_plan = plan if info.startswith("wrote entry") else None
                    if entry_plan is None:
                        print(f"the miss wrote no entry: {info}", flush=True)
            for name in HIT_VARIANTS:
                if name not in args.variants or entry_plan is None:
                    continue
                density = HIT_DENSITY[name]
                hit_ws = f"{ws_hit}_{int(density * 100)}" + ("_raster" if name in RASTER_VARIANTS else "")
                ws = Workspace.open(resolve_workspace(hit_ws))
                if len(ws) == 0:
                    src = Workspace.open(resolve_workspace(ws_miss))
                    eid = src.search(entry_plan.embedding, k=1)[0][0]
                    masks, meta = src.load(eid, packed=True, touch=False)
                    meta = dict(meta, signature=dict(meta["signature"]))
                    if name in RASTER_VARIANTS:
                        meta["signature"]["token_order"] = "thw"
                    order = entry_token_order(meta["signature"])
                    entry_grid = tuple(meta["signature"]["token_grid"])  # the first window's with --windows
                    per_layer = structured_maps(entry_grid, shape["num_heads"], density, shape["num_layers"], device,
                                                order)
                    ws.add(entry_plan.embedding, {key: per_layer[key[2]] for key in masks}, meta)
                    results.setdefault("entry_orders", {})[hit_ws] = meta["signature"].get("token_order")
                if args.compiled_only:
                    if compiling and name in COMPILED_HITS:
                        timed_compiled(name)
                    continue
                per_backend = name in ("hit15", "hit5")
                for backend in [b for b in args.hit_backends if b != "auto"] if per_backend else []:
                    plan_b, _ = retrieve(hit_ws)
                    if timed(f"{name}@{backend}", patched(plan_b, backend=backend), plan_b) is not None:
                        results["runs"][-1]["backend"] = backend
                        if name == "hit15" and device.type == "cuda":
                            results["runs"][-1]["kernel_alone_ms"] = kernel_alone_ms(
                                plan_b, plan_b.token_grid, shape, kernels, sampler, backend=backend)
                if per_backend and "auto" not in args.hit_backends:
                    continue  # the plain (auto) row below runs only when asked for
                plan, t_ret = retrieve(hit_ws)
                assert plan.is_hit, plan.message
                models = patched(plan, fr_share=args.fr_share if name in FEATURE_REUSE_VARIANTS else None,
                                 verify=VERIFY_THRESHOLD_PASSING if name == "hitver" else None,
                                 tail=name not in NO_TAIL_VARIANTS, guidance=name in GUIDED_VARIANTS)
                if timed(name, models, plan) is None:
                    continue
                results["runs"][-1].update(retrieve_s=t_ret)
                if name == "hitver":
                    results["runs"][-1]["verification"] = {str(e): dict(v) for e, v in plan.stats.verification.items()}
                if name == "hit15" and device.type == "cuda":
                    results["runs"][-1]["kernel_alone_ms"] = kernel_alone_ms(plan, plan.token_grid, shape, kernels,
                                                                             sampler)
                if compiling and name in COMPILED_HITS:
                    timed_compiled(name)
            if compiling and "miss" in args.variants and (entry_plan is not None or args.compiled_only):
                timed_compiled("miss")  # (each compiled miss records into a fresh workspace of its own)
        built = experts = None  # the experts' weights go before the next --weights builds its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["wall_s"] = time.perf_counter() - t_start
    return results


def save(results: dict, out_dir) -> None:
    """Write what is measured so far (a run stopped at its time limit still leaves its numbers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comfy_e2e.json").write_text(json.dumps(results, indent=1, default=str))


def kernel_alone_ms(plan, grid, shape, kernels, sampler=None, reps: int = 10, backend: str = "auto") -> dict:
    """The kernel a hit runs by itself: ``block_sparse_attention(backend=backend)`` in the entry's
    token order, as the hit runs it (key ``backend``'s name, e.g. ``"auto"``: its median ms, with the pooled
    tail as the node's default runs it; ``"<name>_no_tail"``: without; ``"backend"``: what it resolved to) on
    random q/k/v in ComfyUI's layout with the map the hit computes for layer 0 of step 0 (entry map + k_min
    floor); for ``"auto"`` also the portable Triton FP8 kernel whole and in its two parts (pre-pass + index,
    attention), without the tail. ``backend``: the one the row's hit runs (a ``--hit-backends`` row names its
    own). ``sampler`` (a ``GpuSampler``): ``"gpu_<name>"`` = the GPU's clock and power while the hit's kernel
    was timed, to set beside the row's ``"gpu"`` (the same kernel inside the model runs at the model's clock).
    ``"<name>_under_load"``: the hit's kernel again, each call queued between the GEMMs of one block's linears
    (:func:`block_linears`; ``"under_load_gemms"`` of them) and timed as the model's calls are timed (events, no
    synchronize; :func:`~chorus.benchmarks.timing.cuda_median_ms_between`), so at the clock such a load holds
    (``"gpu_<name>_under_load"``): the kernel alone at the model's clock, what a call in the model is set beside
    to read the integration's own cost."""
    from chorus.engine.maps import floor_k_min, stored_map

    t, h, w = grid
    length, heads, dim = t * h * w, shape["num_heads"], shape["dim"] // shape["num_heads"]
    stored = stored_map(plan, 0, 0, 0, block_size=128, top_p=0.9, k_min=4, device="cuda")
    block_map = floor_k_min(stored, 4)[None]
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(1, length, heads * dim, device="cuda", dtype=torch.bfloat16, generator=gen)
           .view(1, length, heads, dim).transpose(1, 2) for _ in range(3)]
    from chorus.kernels.triton._attention import launch_attention, prepare_attention

    from ..timing import cuda_median_ms, cuda_median_ms_between

    scale = 1.0 / math.sqrt(dim)
    portable_parts = ("triton_fp8", "prepass_and_index", "attention_kernel") if backend == "auto" else ()
    prep = prepare_attention(*qkv, block_map, 128, scale, True) if portable_parts else None
    out = {}
    from chorus.kernels.api import resolve_backend

    out["backend"] = resolve_backend(backend, qkv[0]).value
    no_tail = f"{backend}_no_tail"

    def timed_call(name):
        def call():
            if name == "prepass_and_index":
                return prepare_attention(*qkv, block_map, 128, scale, True)
            if name == "attention_kernel":
                return launch_attention(prep)
            hit_like = name in (backend, no_tail)
            o = kernels.block_sparse_attention(*qkv, block_map, backend=backend if hit_like else name,
                                               rows_checked=True, token_perm=plan.entry_order if hit_like else None,
                                               pooled_tail=name == backend)
            return o.transpose(1, 2).reshape(1, length, heads * dim)
        return call

    for name in (backend, no_tail) + portable_parts:
        if name == backend and sampler is not None:
            with sampler.window() as window:
                out[name] = cuda_median_ms(timed_call(name), reps, warmup=2)
            out[f"gpu_{backend}"] = window.summary()
        else:
            out[name] = cuda_median_ms(timed_call(name), reps, warmup=2)
    linears, gemms = block_linears(length, shape["dim"], shape["ffn_dim"])
    with (sampler.window() if sampler is not None else contextlib.nullcontext()) as window:
        out[f"{backend}_under_load"] = cuda_median_ms_between(timed_call(backend), linears, reps=2 * reps)
    out["under_load_gemms"] = gemms
    if window is not None:
        out[f"gpu_{backend}_under_load"] = window.summary()
    out["density"] = float(block_map.float().mean())
    return out


def block_linears(length: int, dim: int, ffn_dim: int):
    """``(run, n)``: ``run()`` queues the GEMM work of one Wan block's linear layers at ``length`` tokens --
    self-attention's q, k, v, o and cross-attention's q, o (``dim x dim`` each) and the feed-forward's
    ``dim x ffn_dim`` pair -- as ``n`` bf16 GEMMs ``[length, dim] @ [dim, dim]`` of the same total FLOPs
    (``n = round((6 dim + 2 ffn_dim) / dim)``, 11 for Wan 14B), on random data (the same input each
    time: a chained product would drift to inf). The load that holds the GPU's clock near where the model
    holds it around an attention call (:func:`chorus.benchmarks.timing.cuda_median_ms_between`; measured a
    little lower, as the model's elementwise work draws less power); 2 ``length x dim`` buffers."""
    gemms = max(1, round((6 * dim + 2 * ffn_dim) / dim))
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(length, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(dim)
    y = torch.empty_like(x)

    def run():
        for _ in range(gemms):
            torch.matmul(x, weight, out=y)

    return run, gemms


def gpu_sampler(device):
    """The GPU's SM clock, power and clock-limit reasons sampled every 50 ms while a window is open
    (``benchmarks/kernels/gpu_state.py``; NVML); on the CPU, or without NVML, windows report
    ``available: False``."""
    from ..kernels.gpu_state import GpuSampler

    return GpuSampler(index=device.index or 0, interval_s=0.05,
                      off_reason="" if device.type == "cuda" else "a CPU run")


def profile_step(step, top: int = 40) -> dict:
    """One sampling step (the high expert's step 0 -> 1, after the timed request) under
    ``torch.profiler`` (CPU and, where there is one, CUDA activity): total GPU time, the ``top`` kernels by GPU time,
    ``name -> [ms, calls]`` (names cut at 100 characters), and per ``chorus::`` custom op the GPU time
    of the kernels run inside its calls (``ops``: :func:`chorus_op_times`; ``chorus::attend``: a hit's
    sparse attention calls, pre-pass, block lists and kernel together; empty, with ``ops_error`` saying why, where
    this torch's raw profiler events lack what it reads). Where a request's time goes, not a timing of record (the profiler adds its own host overhead; kernel durations are the GPU's)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CPU:
            continue
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if us > 0:
            name = event.key[:100]
            ms, calls = kernels.get(name, (0.0, 0))
            kernels[name] = (ms + us / 1000.0, calls + event.count)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    out = {"gpu_ms_total": sum(ms for ms, _ in kernels.values()),
           "kernels": {name: [round(ms, 3), calls] for name, (ms, calls) in ranked[:top]}, "ops": {}}
    try:
        out["ops"] = chorus_op_times(prof.profiler.kineto_results.events())
    except AttributeError as exc:  # a torch whose raw events lack an accessor: the row keeps its other numbers
        out["ops_error"] = f"{type(exc).__name__}: {exc}"
    return out


def chorus_op_times(events) -> dict:
    """Per ``chorus::`` custom op in a profile's raw events (``torch.profiler``'s kineto events, as
    ``prof.profiler.kineto_results.events()`` gives them: ``name()``, ``device_type()``, ``start_ns()``,
    ``duration_ns()``, ``correlation_id()``, ``linked_correlation_id()``): ``name -> [ms, calls, events]``, the GPU time of the
    device work (kernels, copies, memsets) launched inside its calls, how many calls launched any, and every
    event of that name.

    A device activity belongs to the call during which the host launched it: its launch is the host-side
    runtime / driver event of the same correlation id (a host event linked to an op; an op is a host event
    linked to none), and the call is the outermost ``chorus::`` op event
    whose host interval holds that launch's start (the benchmark launches from one thread). The profiler's
    own op-to-kernel link is not used: in a 40-layer step it gave each compiled call the GEMMs of its layer
    (55 ms a call against a 24.5 ms per-call median) and each eager call 1.2 ms too much (H200, 2026-12-04;
    right at 3 layers). A call counts once: an op event inside another ``chorus::`` event (the op's
    implementation dispatched again) is part of it, and one that launched nothing is not a call (dynamo
    tracing the op with fake tensors, in a step that recompiles; on the CPU nothing is launched, so there
    are events and no calls)."""
    cpu = torch.autograd.DeviceType.CPU
    host = [e for e in events if e.device_type() == cpu]
    op_events = sorted((e for e in host if e.linked_correlation_id() == 0 and e.name().startswith("chorus::")),
                       key=lambda e: e.start_ns())
    seen: dict[str, int] = {}
    calls: list[list] = []  # outermost calls in start order: [name, start_ns, end_ns, device ns, launched]
    for event in op_events:
        seen[event.name()] = seen.get(event.name(), 0) + 1
        if calls and event.start_ns() < calls[-1][2]:
            continue  # inside the call before it
        calls.append([event.name(), event.start_ns(), event.start_ns() + event.duration_ns(), 0, False])
    launches = {e.correlation_id(): e.start_ns() for e in host if e.linked_correlation_id() > 0}
    starts = [call[1] for call in calls]
    for activity in events:
        launched = launches.get(activity.correlation_id()) if activity.device_type() != cpu else None
        if launched is None:
            continue
        index = bisect.bisect_right(starts, launched) - 1
        if index >= 0 and launched <= calls[index][2]:
            calls[index][3] += activity.duration_ns()
            calls[index][4] = True
    ops = {name: [0.0, 0, count] for name, count in seen.items()}
    for name, _start, _end, device_ns, launched in calls:
        if launched:
            ops[name][0] += device_ns / 1e6
            ops[name][1] += 1
    return {name: [round(ms, 3), n, count] for name, (ms, n, count) in ops.items()}


def attention_kernels_ms(profile: dict | None) -> float | None:
    """GPU time of one ``chorus::attend`` call's kernels in a profiled step (:func:`profile_step`), or None
    where the step ran none. Beside the row's per-call time (CUDA events in the timed request) it gives what
    a call costs over its kernels, both measured inside the model at the clock it runs at."""
    ms, calls = ((profile or {}).get("ops", {}).get("chorus::attend") or (0.0, 0))[:2]
    return ms / calls if calls else None


def table(results: dict) -> str:
    rows = results["runs"]
    lines = ["| weights | res | variant | request s | vs dense | first request s | attention ms/layer | density | peak GiB "
             "| SM MHz (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "seconds" not in r:  # skipped, or failed
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['failed']}"
            lines.append(f"| {r['weights']} | {r['res']} | {r['variant']} | {why} | | | | | | |")
            continue
        base = next((x for x in rows if x["weights"] == r["weights"] and x["res"] == r["res"] and "seconds" in x
                     and x["variant"] == ("dense+compile" if "compile" in r["variant"] else "dense")), None)
        # a request that still compiled (every try recompiled) times the compiler: no ratio from it or to it
        steady = base is not None and not base.get("timed_request_frames_compiled") \
            and not r.get("timed_request_frames_compiled")
        ratio = f"{base['seconds'] / r['seconds']:.2f}x" if steady else "-"
        attn = f"{r['attn_ms_per_layer']:.2f}" if r.get("attn_ms_per_layer") is not None else "-"
        if r.get("attn_kernels_ms_per_call") is not None and r.get("attn_ms_median") is not None:
            attn += f" (median {r['attn_ms_median']:.2f}, its kernels {r['attn_kernels_ms_per_call']:.2f})"
        alone_ms = r.get("kernel_alone_ms") or {}
        alone = alone_ms.get(r.get("backend", "auto"))
        if alone is not None:
            loaded = alone_ms.get(f"{r.get('backend', 'auto')}_under_load")
            attn += f" (alone {alone:.2f}" + (f", between GEMMs {loaded:.2f})" if loaded is not None else ")")
        dens = f"{r['density']:.1%}" if r.get("density") is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        first = f"{r['first_request_s']:.1f}" if r.get("first_request_s") is not None else "-"
        spent = r.get("first_request_compile")
        if spent:
            first += f" (compile {spent['dynamo_s']:.1f}"
            first += f", Triton builds {spent['triton_build_s']:.1f})" if spent["triton_build_s"] is not None else ")"
        gpu = r.get("gpu") or {}
        clock = f"{gpu['sm_mhz']:.0f}" if gpu.get("available") else "-"
        variant = r["variant"]
        if any(e["partial"] for e in r.get("comfy_loading") or ()):
            variant += " (experts loaded partially)"
        recompiles = (r.get("dynamo") or {}).get("recompiles")
        if recompiles:
            variant += f" ({recompiles} recompiles)"
        unsteady = r.get("unsteady_requests") or ()
        if unsteady:
            variant += (f" (timed: request {len(unsteady) + 2}, the first that compiled nothing; before it "
                        + " / ".join(f"{u['seconds']:.2f} s" for u in unsteady) + ")")
        if r.get("timed_request_frames_compiled"):
            variant += f" (the timed request compiled {r['timed_request_frames_compiled']} frames)"
        lines.append(f"| {r['weights']} | {r['res']} | {variant} | {r['seconds']:.2f} | {ratio} | {first} | "
                     f"{attn} | {dens} | {peak} | {clock} |")
    return "\n".join(lines)


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
