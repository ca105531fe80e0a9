"""sglang-oea: Opportunistic Expert Activation (arXiv 2511.02237) as an SGLang plugin.

Layers, with imports pointing one way:
    reference, routing, config, sizing   pure torch / Python, no SGLang import
    kernels                              fused Triton kernel, no SGLang import
    plugin, hooks, ...                   the thin layer that hooks SGLang 0.5.23
"""

__version__ = "0.1.0"
