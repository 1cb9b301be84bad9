"""Chorus II engine: the host-agnostic request runtime (see README.md for the public API).

Importing it needs torch and ``chorus.kernels`` / ``chorus.cache_store`` only, never ComfyUI or diffusers
(the diffusers adapter is ``chorus.hosts.diffusers``, the ComfyUI one ``nodes/``).
"""

from .call import AttnCall
from .config import BACKENDS, SparseConfig
from .maps import floor_k_min
from .plan import Candidate, Plan, PlanStats, Retrieval
from .preview import mask_heatmap, placeholder
from .recorder import MassRecorder
from .retrieval import build_signature, commit_plan, retrieve_plan
from .routing import SigmaSchedule, match_step, step_sigma
from .runtime import ChorusAttention
from .compat import latent_compatibility
from .model_info import SUPPORTED_VARIANTS, ModelInfo, token_grid, wan_model_info, weights_fingerprint
from .state import RequestState

__all__ = [
    "AttnCall", "BACKENDS", "SparseConfig", "Candidate", "Plan", "PlanStats", "Retrieval", "RequestState",
    "mask_heatmap", "placeholder", "MassRecorder",
    "build_signature", "commit_plan", "retrieve_plan", "SigmaSchedule", "match_step", "step_sigma",
    "ChorusAttention", "floor_k_min", "SUPPORTED_VARIANTS", "ModelInfo", "latent_compatibility", "token_grid",
    "wan_model_info", "weights_fingerprint",
]
