"""SGLang plugin `oea_cpu_harness`: lets `cpu_serve` run `--tp N` and speculative decoding on the CPU.

It changes nothing about routing. Its entry point is sglang_oea.cpu_entry, which imports this
module and installs its hooks only when the CPU stand-in `sgl_kernel` (see cpu_serve) is the one
this process would import: a GPU server never imports it.

Why it exists:
- `--tp N`: SGLang 0.5.23 decides whether a process group gets a PyNccl communicator from the
  platform, not from the group's device (`init_model_parallel_group`), so with `--tp 2` on the
  CPU engine every group builds one and fails with "Expected a cuda device, but got: cpu". With
  no NCCL or custom communicator, `GroupCoordinator.all_reduce` on CPU tensors uses
  torch.distributed over the gloo group, which is what a CPU run needs.
- `--speculative-algorithm`: the CPU attention backend (`torch_native`) has no target-verify
  path: it reads `extend_prefix_lens`, which verify batches leave unset, and fails. The hook runs
  verify passes through `verify_attention` below (tree-masked attention over the KV cache).
- MLA (the DeepSeek-V2/V3 family, GLM-5's attention): `torch_native` cannot run the expanded
  multi-head path SGLang picks for a prefill with no cached prefix; mla.py sends it through
  the absorbed MLA path instead.
- `--speculative-algorithm EAGLE` with an MTP draft: eagle.py (draft attention backends on
  `torch_native`, no CUDA synchronisation on the CPU).
- `--attn-dp-size N` (DP attention): each rank pads its batch to the layout the ranks agreed on,
  asking the attention backend for a CPU fill value `torch_native` lacks; dp_attention.py gives it
  SGLang's usual one.
- `--enable-return-routed-experts`: capture.py (the capture's host buffer, which SGLang page-locks
  with cudaHostRegister, allocated unpinned: there is no CUDA driver to register it with).

It is a separate plugin from `oea` so that a baseline can load it alone
(SGLANG_PLUGINS=oea_cpu_harness): plain SGLang routing, on the CPU.
"""

from sglang_oea.cpu import capture as cpu_capture, dp_attention as cpu_dp_attention, eagle as cpu_eagle, mla as cpu_mla

PARALLEL_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
TORCH_NATIVE_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"


def cpu_group_kwargs(group_ranks, local_rank, backend, *rest, **kwargs):
    """BEFORE hook: no PyNccl or custom all-reduce for groups of a CPU run (all of them)."""
    if rest:  # SGLang passes these three positionally and the rest by name; anything else is new
        raise TypeError(f"oea_cpu_harness: unexpected positional arguments to {PARALLEL_GROUP}: {rest!r}")
    kwargs.update(use_pynccl=False, use_custom_allreduce=False)
    return (group_ranks, local_rank, backend), kwargs


def verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache: bool = True):
    """Attention of a target-verify pass: each request's D draft tokens see its whole cached prefix
    (seq_lens[b] tokens) and, among the drafts, those its tree mask marks.

    Args:
        q: [B * D, Hq * Dqk]; k, v: [B * D, Hkv, Dqk / Dv], written to the KV cache first.
        forward_batch.spec_info.custom_mask: [R * D * D] bool for the R <= B real requests, mask[b, i, j]: draft i sees draft j.
            This is the draft-only (QLEN_ONLY) tree mask, which SGLang builds on the CPU for both
            NGRAM and EAGLE (`speculative/eagle_utils.py`, default_tree_mask_mode: QLEN_ONLY when
            on the CPU), not the prefix-wide FULL_MASK of the GPU kernels; tested with both.
    Returns:
        [B * D, Hq * Dv].
    """
    import torch
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    rows = forward_batch.batch_size
    drafts = forward_batch.spec_info.draft_token_num
    # Under DP attention SGLang pads a group's verify batch to the agreed request count; the tree
    # mask covers the real requests only, and the padded rows' output is never read: zeros.
    real = min(rows, forward_batch.spec_info.custom_mask.numel() // (drafts * drafts))
    tree = forward_batch.spec_info.custom_mask[:real * drafts * drafts].view(real, drafts, drafts).bool()
    query = q.view(rows, drafts, layer.tp_q_head_num, layer.qk_head_dim).transpose(1, 2)  # [B, Hq, D, Dqk]
    out = q.new_zeros(rows, drafts, layer.tp_q_head_num, layer.v_head_dim)
    keys, values = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    for b in range(real):
        prefix = int(forward_batch.seq_lens[b])
        slots = backend.req_to_token_pool.req_to_token[forward_batch.req_pool_indices[b], :prefix + drafts].long()
        mask = torch.cat([tree.new_ones(drafts, prefix), tree[b]], dim=1)  # [D, prefix + D]
        key = keys[slots].transpose(0, 1).to(query.dtype)  # [Hkv, prefix + D, Dqk]
        value = values[slots].transpose(0, 1).to(query.dtype)
        attended = torch.nn.functional.scaled_dot_product_attention(
            query[b:b + 1], key[None], value[None], attn_mask=mask, scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
        out[b] = attended[0].transpose(0, 1)
    return out.view(rows * drafts, -1)


def verify_aware_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook: target-verify passes through verify_attention, every other extend unchanged."""
    if forward_batch.forward_mode.is_target_verify():
        return verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache)
    return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


def install_hooks() -> None:
    """The harness's hooks, registered with SGLang's HookRegistry. Called by the entry point
    `oea_cpu_harness` (sglang_oea.cpu_entry.register) once it found the CPU stand-in."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PARALLEL_GROUP, cpu_group_kwargs, HookType.BEFORE)
    HookRegistry.register(TORCH_NATIVE_EXTEND, verify_aware_extend, HookType.AROUND)
    cpu_mla.register_hooks()  # MLA attention (DeepSeek-V2/V3, GLM-5) on torch_native
    cpu_eagle.register()  # EAGLE / MTP drafts on the CPU engine (cpu/eagle.py)
    cpu_capture.register_hooks()  # --enable-return-routed-experts: unpinned host buffers (cpu/capture.py)
    cpu_dp_attention.register_hooks()  # --attn-dp-size: padding of the ranks' agreed layout (cpu/dp_attention.py)
