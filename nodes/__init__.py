"""ComfyUI nodes of Chorus II (V3 API). Imported only by the pack's ``comfy_entrypoint``.

One module per node; ``comfy_patch`` holds the one Chorus patch per model the nodes configure,
``comfy_adapter`` the LoRA-aware model identity. Node ids are public API.
"""

from comfy_api.latest import ComfyExtension

from .cache_maintenance import ChorusCacheMaintenance
from .cache_write import ChorusCacheWrite
from .feature_reuse import ChorusFeatureReuse
from .guidance_boost import ChorusGuidanceBoost
from .mask_retrieve import ChorusMaskRetrieve
from .sparse_sampler import ChorusSparseSampler

NODES = [ChorusMaskRetrieve, ChorusSparseSampler, ChorusFeatureReuse, ChorusGuidanceBoost, ChorusCacheWrite,
         ChorusCacheMaintenance]


class ChorusExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
