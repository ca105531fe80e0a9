"""CPU-only hooks that let EAGLE / MTP speculative decoding run on SGLang's CPU engine.

Registered by the `oea_cpu_harness` plugin (harness.install_hooks), so only when the CPU stand-in
`sgl_kernel` is active; a GPU run never reaches them. Nothing here touches routing.

On the CPU, SGLang 0.5.23 runs EAGLE through `EAGLEWorkerV2` without the overlap schedule (it
turns overlap off itself: `_disable_overlap_schedule_for_cpu` in arg_groups/speculative_hook.py).
One step: the draft model proposes S tokens per request (draft decode, S - 1 forward passes), the
target verifies them in one TARGET_VERIFY pass (harness.verify_attention), and the draft model
re-reads the verified window (draft extend, an ordinary causal extend). The hooks:

- `EagleDraftWorker.init_lm_head`: the draft shares the target's embedding and LM head through
  the model's `set_embed_and_head`, which ends with `torch.cuda.empty_cache()` and
  `torch.cuda.synchronize()` (GLM-4 MoE, DeepSeek-V2/V3); run it with those two as CPU no-ops.
- `DraftBackendFactory.create_decode_backend` / `create_draft_extend_backend`: SGLang has no
  draft backends for `torch_native` (only intel_amx on the CPU). The draft-extend backend is a
  plain TorchNativeAttnBackend; the decode backend is `TorchNativeDraftSteps` below, whose step
  backends read the KV cache through a per-step view of the request table.

The draft tree's kernels (KV slots, tree building, bonus tokens) have plain-torch bodies in the
stand-in `sgl_kernel` (cpu/stub/sgl_kernel/eagle_bodies.py).
"""

import contextlib
import copy
import functools
import types

INIT_LM_HEAD = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head"
DRAFT_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"
CREATE_DRAFT_DECODE = DRAFT_FACTORY + ".create_decode_backend"
CREATE_DRAFT_EXTEND = DRAFT_FACTORY + ".create_draft_extend_backend"
TORCH_NATIVE = "torch_native"


@contextlib.contextmanager
def cuda_housekeeping_as_noops():
    """Within the block, torch.cuda.synchronize and torch.cuda.empty_cache do nothing: on the CPU
    there is no device queue to wait for and no CUDA cache to free."""
    import torch

    saved = torch.cuda.synchronize, torch.cuda.empty_cache
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.empty_cache = saved


def share_embed_and_head_on_cpu(original, worker, *args, **kwargs):
    """AROUND hook on EagleDraftWorker.init_lm_head."""
    with cuda_housekeeping_as_noops():
        return original(worker, *args, **kwargs)


def draft_decode_table(req_to_token, req_pool_indices, seq_lens, topk: int, num_steps: int):
    """Per-branch request table of a draft-decode pass (rows = requests x branches).

    The scheduler allocated each request's draft slots right after its L committed tokens, branch
    after branch: branch t's S slots are req_to_token[req, L + t * S : L + (t + 1) * S]. Branch t
    of request b reads its prefix and its own slots, so row b * K + t of the table is
    req_to_token[req, :L] followed by those S slots.

    Args:
        req_to_token: [R, P] int32; req_pool_indices, seq_lens: [B] int.
    Returns:
        table: [B * K, max(L) + S] int32 (entries past a row's L + S are unused).
        prefix: [B * K] int64, each row's L.
    """
    import torch

    lengths = seq_lens.tolist()
    table = req_to_token.new_zeros(len(lengths) * topk, max(lengths, default=0) + num_steps)
    for b, (row, length) in enumerate(zip(req_pool_indices.tolist(), lengths)):
        for t in range(topk):
            start = length + t * num_steps
            table[b * topk + t, :length] = req_to_token[row, :length]
            table[b * topk + t, length:length + num_steps] = req_to_token[row, start:start + num_steps]
    prefix = seq_lens.to(torch.int64).repeat_interleave(topk)
    return table, prefix


@functools.lru_cache(maxsize=None)
def draft_step_backend_type():
    """The class of one draft-decode step's backend (built on first use: it subclasses SGLang's
    TorchNativeAttnBackend, which this module must not import at plugin load)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class DraftStepAttnBackend(TorchNativeAttnBackend):
        """Step `step` of the draft's decode: row b * K + t attends to its request's prefix and to
        the first step + 1 slots of its branch. It runs TorchNativeAttnBackend's own decode (and
        whatever other hooks wrap it, e.g. for MLA) on a view: the per-branch table as the request
        table, rows 0..B*K-1 as the requests, prefix + step + 1 as their lengths."""

        def __init__(self, model_runner, step: int):
            super().__init__(model_runner)
            self.step = step
            self.view = None  # (request-table pool, row indices, kv lengths), set per pass

        def set_view(self, table, prefix) -> None:
            import torch

            rows = torch.arange(table.shape[0], dtype=torch.int64)
            self.view = types.SimpleNamespace(req_to_token=table), rows, prefix + self.step + 1

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            pool, rows, lengths = self.view
            view = copy.copy(forward_batch)  # the slots written (out_cache_loc) stay the batch's
            view.req_pool_indices, view.seq_lens, view.seq_lens_cpu = rows, lengths, lengths
            shared_pool, self.req_to_token_pool = self.req_to_token_pool, pool
            try:
                return super().forward_decode(q, k, v, layer, view, save_kv_cache, **kwargs)
            finally:
                self.req_to_token_pool = shared_pool

    return DraftStepAttnBackend


class TorchNativeDraftSteps:
    """The draft's multi-step decode backend on torch_native: one step backend for each of the
    S - 1 draft forward passes (EagleDraftWorker.draft_forward enters `attn_backends[i]` for step i).
    """

    def __init__(self, model_runner, topk: int, num_steps: int):
        if getattr(model_runner.token_to_kv_pool, "swa_layer_nums", 0):
            raise NotImplementedError("sglang-oea CPU EAGLE: sliding-window KV pools are not supported")
        step_type = draft_step_backend_type()
        self.topk, self.num_steps = topk, num_steps
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.attn_backends = [step_type(model_runner, step) for step in range(num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        table, prefix = draft_decode_table(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                           forward_batch.seq_lens, self.topk, self.num_steps)
        for backend in self.attn_backends:
            backend.set_view(table, prefix)


def stamp(backend, name: str = TORCH_NATIVE):
    """Name the backend the way DraftBackendFactory names the ones it builds."""
    backends = [backend, *getattr(backend, "attn_backends", [])]
    for each in backends:
        each.prefill_attention_backend_str = each.decode_attention_backend_str = name
    return backend


def draft_backend_name(factory, for_decode: bool) -> str:
    """The attention backend DraftBackendFactory would build for the draft (its own rule)."""
    from sglang.srt.runtime_context import attention_backends, get_spec

    prefill, decode = attention_backends()
    use_decode = for_decode or get_spec().speculative_attention_mode == "decode"
    return factory.draft_attn_backend or (decode if use_decode else prefill)


def draft_decode_backend(original, factory, *args, **kwargs):
    """AROUND hook on DraftBackendFactory.create_decode_backend: TorchNativeDraftSteps for torch_native."""
    if draft_backend_name(factory, for_decode=True) != TORCH_NATIVE or factory.speculative_num_steps <= 1:
        return original(factory, *args, **kwargs)
    return stamp(TorchNativeDraftSteps(factory.draft_model_runner, factory.topk, factory.speculative_num_steps))


def draft_extend_backend(original, factory, *args, **kwargs):
    """AROUND hook on DraftBackendFactory.create_draft_extend_backend: TorchNativeAttnBackend for
    torch_native (draft extend is an ordinary causal extend over the verified window)."""
    if draft_backend_name(factory, for_decode=False) != TORCH_NATIVE:
        return original(factory, *args, **kwargs)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return stamp(TorchNativeAttnBackend(factory.draft_model_runner))


def register() -> None:
    """Register the EAGLE hooks (called by harness.install_hooks when the stand-in is active)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INIT_LM_HEAD, share_embed_and_head_on_cpu, HookType.AROUND)
    HookRegistry.register(CREATE_DRAFT_DECODE, draft_decode_backend, HookType.AROUND)
    HookRegistry.register(CREATE_DRAFT_EXTEND, draft_extend_backend, HookType.AROUND)
