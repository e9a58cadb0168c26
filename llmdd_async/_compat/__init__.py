"""The blocking faces: upstream ``llm_datadist``'s Python API (``facade``), its C++-style
``LlmDataDist`` (``cpp_style``) and the multi-device KV cache manager (``multi_device``).

Each runs the async API on a loop thread it owns; nothing below imports from here.
"""
