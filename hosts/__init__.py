"""Adapters for hosts other than ComfyUI (whose glue is ``nodes/``); each is thin glue around
``chorus.engine``. ``hosts.diffusers``: diffusers' ``WanTransformer3DModel``."""
