"""sglang-oea: Opportunistic Expert Activation (arXiv 2511.02237) as an SGLang plugin.

Layers, with imports pointing one way:
    reference, routing, config, flags,      pure torch / Python, no SGLang import
    routers, self_check, runtime
    kernels                                 fused Triton kernel, no SGLang import
    plugin, hooks, metrics,                 the thin layer that hooks SGLang 0.5.23
    routing_scope, startup_checks
"""

__version__ = "0.1.0"
