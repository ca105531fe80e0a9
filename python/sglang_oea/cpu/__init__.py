"""The CPU harness: what runs the real SGLang server on a machine with no GPU.

Nothing here is loaded by a GPU server. `serve` starts `sglang serve` on the CPU engine, `stub`
is the stand-in `sgl_kernel`, `harness` is the `oea_cpu_harness` plugin (with `mla` and `eagle`),
and `tiny_model` writes small MoE checkpoints. The OEA plugin itself never imports this package.
"""
