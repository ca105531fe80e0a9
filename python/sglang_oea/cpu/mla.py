"""CPU harness hook for multi-latent attention (MLA: the DeepSeek-V2/V3 family, GLM-5's attention).

One hook, registered by the `oea_cpu_harness` plugin only when the CPU stand-in `sgl_kernel` is in
use (harness.install_hooks):

- `absorbed_on_torch_native` (AROUND `DeepseekV2AttentionMLA.dispatch_attn_forward_method`): on the
  `torch_native` backend every MLA forward takes the absorbed path (AttnForwardMethod.MLA).

Why. SGLang 0.5.23 chooses, per forward batch, how an MLA layer attends. `torch_native` has no
handler of its own (models/deepseek_common/attention_backend_handler.py) and gets the Triton
backend's: plain multi-head attention (MHA) for a prefill with no cached prefix, the absorbed MLA
path for every other batch. The MHA path writes the latent KV to the MLA pool itself, then calls
the backend with the expanded per-head keys and values and save_kv_cache=False:

    q, k: [T, H, Dnope + Drope]   v: [T, H, Dv]   (the backend is to attend over these)

The Triton backend does; `torch_native` always attends over what its KV pool holds, which under MLA
is the latent row [S, 1, Dkv + Drope], so the first prefill fails ("Expected size ... [4, 48] but
got: [4, 80]" for Dnope 32, Drope 16, Dkv 64). The absorbed path is the one `torch_native` already
runs correctly for decode and for extends over a cached prefix:

    q: [T, H, Dkv + Drope] (q_nope absorbed through kv_b_proj's key half, then q_rope)
    k: [T, 1, Dkv + Drope] (the latent row it stores)   v: [T, 1, Dkv] (its first Dkv columns)

and it is the same attention in exact arithmetic: q_nope . (W_k c) = (W_k^T q_nope) . c, and the
output's value projection is applied after the softmax. Sending the no-prefix prefill there too
keeps every MLA computation on the CPU inside SGLang's own code. The GPU path never sees this hook.
"""

MLA_DISPATCH = "sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA.dispatch_attn_forward_method"
CPU_BACKEND = "torch_native"


def absorbed_on_torch_native(original, attn, forward_batch, *args, **kwargs):
    """AROUND hook: SGLang's choice, except that an MHA method on `torch_native` becomes MLA.

    Returns:
        AttnForwardMethod: the method `attn` (a DeepseekV2AttentionMLA) runs for `forward_batch`.
    """
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    method = original(attn, forward_batch, *args, **kwargs)
    expanded = (AttnForwardMethod.MHA, AttnForwardMethod.MHA_CHUNKED_KV, AttnForwardMethod.MHA_ONE_SHOT)
    # dispatch_attn_forward_method records on the layer the backend it chose for this batch.
    if attn.current_attention_backend == CPU_BACKEND and method in expanded:
        return AttnForwardMethod.MLA
    return method


def register_hooks() -> None:
    """Register the hook above with SGLang's HookRegistry (harness.install_hooks calls this)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(MLA_DISPATCH, absorbed_on_torch_native, HookType.AROUND)
