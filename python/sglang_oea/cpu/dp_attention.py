"""CPU harness hooks for SGLang's DP attention (`--tp N --attn-dp-size M`) on the CPU engine.

Registered by the `oea_cpu_harness` plugin only when the CPU stand-in `sgl_kernel` is in use
(harness.install_hooks):

- `cpu_fill_value_for_padding` (BEFORE `ForwardBatch._pad_inputs_to_size`): a backend without a
  CPU-graph fill value gets SGLang's usual one, 1.

Why. Under DP attention every rank pads its batch to the layout the ranks agreed on
(`ForwardBatch.prepare_mlp_sync_batch`), and on the CPU `_pad_inputs_to_size` asks the attention
backend for `get_cpu_graph_seq_len_fill_value()`, the length a padded request pretends to have.
Only SGLang's own CPU backend (intel_amx, which needs the real CPU `sgl_kernel`) defines it;
`torch_native` does not, so both schedulers stop at the first batch. 1 is what intel_amx answers on
the CPU and what SGLang's GPU backends (triton, flashinfer, flashattention) answer for their CUDA
graphs: a padded row attends over one cached slot, finite and never read back. The GPU path never
sees this hook.
"""

PAD_INPUTS = "sglang.srt.model_executor.forward_batch_info.ForwardBatch._pad_inputs_to_size"
CPU_FILL = "get_cpu_graph_seq_len_fill_value"
PADDED_SEQ_LEN = 1


def padded_seq_len() -> int:
    """The length of a padded request: SGLang's fill value for torch_native's padded rows."""
    return PADDED_SEQ_LEN


def cpu_fill_value_for_padding(batch, model_runner, *args, **kwargs):
    """BEFORE hook: give the model runner's attention backend a CPU fill value when it has none."""
    backend = model_runner.attn_backend
    if not hasattr(backend, CPU_FILL):
        setattr(backend, CPU_FILL, padded_seq_len)
    return None


def register_hooks() -> None:
    """Register the hooks above with SGLang's HookRegistry (harness.install_hooks calls this)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PAD_INPUTS, cpu_fill_value_for_padding, HookType.BEFORE)
