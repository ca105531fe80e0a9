"""The CPU harness: what runs the real SGLang server on a machine with no GPU.

Nothing here is loaded by a GPU server. `serve` starts `sglang serve` on the CPU engine, `stub`
is the stand-in `sgl_kernel`, `harness` is the `oea_cpu_harness` plugin's hooks (with `mla`,
`eagle`, `capture` and `dp_attention`), and `tiny_model` writes small MoE checkpoints. The OEA
plugin itself never imports this package, and the `oea_cpu_harness` entry point
(sglang_oea.cpu_entry) imports it only in a process that runs on the stand-in `sgl_kernel`.
"""
