"""sglang-oea: Opportunistic Expert Activation (arXiv 2511.02237) as an SGLang plugin.

Layers, with imports pointing one way:
    reference, routing, config, flags,      pure torch / Python, no SGLang import
    routers, self_check, runtime
    kernels                                 fused Triton kernel, no SGLang import
    plugin, hooks, metrics,                 the thin layer that hooks SGLang 0.5.23
    routing_scope, startup_checks

The runtime (one per process) is the façade the hooks call; behind it, with no SGLang import:
    passes          what forward pass is running, and the batch gate over it
    layer_router    one MoE layer routed: its TopKConfig read once, the chosen router run, counted
    accounting      each pass, once it ends: applied, or skipped with the reason
    counters        the per-layer device counters and the snapshots the host reads them through
    router_dump     --oea-dump-router-logits
"""

__version__ = "0.1.0"
