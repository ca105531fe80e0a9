"""EAGLE with an MTP (nextn) draft on SGLang's CPU engine, without a server: the stand-in
sgl_kernel's EAGLE bodies (cpu/stub/sgl_kernel/eagle_bodies.py) against SGLang's own Triton
kernels, and the draft's decode attention (sglang_oea.cpu.eagle) against a brute-force one. The
server test (EAGLE with the trained DeepSeek-V3 checkpoint's MTP layer as the draft, OEA in the
target's verify passes only) is in test_cpu_deepseek.py.

The Triton comparisons run in a TRITON_INTERPRET=1 child (Triton reads the variable once, at import).
"""

import math
import os
import types

import pytest
import torch

from oea_fixtures import run_in_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter child")
QLEN_ONLY, FULL_MASK = 1, 0  # sglang's TreeMaskMode values


@pytest.fixture
def bodies():
    from sgl_kernel import eagle_bodies

    return eagle_bodies


# ----------------------------------------------------------------------------- stand-in ops


@interpreted
def test_assign_draft_cache_locs(bodies):
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous

    gen = torch.Generator().manual_seed(0)
    pool_len, topk, steps = 40, 3, 2
    req_to_token = torch.randperm(5 * pool_len, generator=gen).view(5, pool_len).int()
    rows, seq_lens = torch.tensor([4, 0, 2]), torch.tensor([7, 0, 33])
    want, got = torch.zeros(3 * topk * steps, dtype=torch.int64), torch.zeros(3 * topk * steps, dtype=torch.int64)
    assign_draft_cache_locs_contiguous[(3,)](rows, req_to_token, seq_lens, want, pool_len, topk, steps, BS=3)
    bodies.assign_draft_cache_locs_contiguous_cpu(rows, req_to_token, seq_lens, got, pool_len, topk, steps)
    assert torch.equal(got, want)


def draft_choices(gen, batch: int, topk: int, steps: int, draft_tokens: int):
    """(parent_list, top_scores_index) as EagleDraftWorker.draft_forward hands them to the tree
    build: SGLang's own select_top_k_tokens and organize_draft_results over random draft scores."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    def proposals(rows):
        probs, tokens = torch.rand(rows, 50, generator=gen).softmax(1).topk(topk)
        return probs, tokens

    topk_p, topk_index = proposals(batch)
    hidden, scores, trees = torch.zeros(batch, 4), None, []
    for i in range(steps):
        _, hidden, scores, tree = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        trees.append(tree)
        topk_p, topk_index = proposals(batch * topk)
    parent_list, top_scores_index, _ = organize_draft_results(*map(list, zip(*trees)), draft_tokens)
    return parent_list, top_scores_index


def built_trees(build, parent_list, top_scores_index, seq_lens, topk, steps, draft_tokens, mode):
    """The outputs of one tree build (SGLang's or the stand-in's), from the buffers SGLang hands it."""
    batch = seq_lens.numel()
    prefix = int(seq_lens.sum()) if mode == FULL_MASK else 0
    mask = torch.ones(prefix * draft_tokens + batch * draft_tokens * draft_tokens, dtype=torch.bool)
    positions = torch.zeros(batch * draft_tokens, dtype=torch.int64)
    links = torch.full((3, batch, draft_tokens), -1, dtype=torch.int64)
    build(parent_list, top_scores_index, seq_lens, mask, positions, *links, topk, steps, draft_tokens, mode)
    return mask, positions, links


@interpreted
@pytest.mark.parametrize("topk,steps,draft_tokens", [(1, 3, 4), (3, 3, 5), (2, 4, 7)])
@pytest.mark.parametrize("mode", [QLEN_ONLY, FULL_MASK])
def test_build_tree(bodies, topk, steps, draft_tokens, mode):
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    gen = torch.Generator().manual_seed(topk * 10 + steps)
    batch = 3
    parent_list, top_scores_index = draft_choices(gen, batch, topk, steps, draft_tokens)
    seq_lens = torch.tensor([5, 1, 12])
    want = built_trees(sgl_build_tree_kernel_triton, parent_list, top_scores_index, seq_lens, topk, steps,
                       draft_tokens, mode)
    got = built_trees(bodies.build_tree_kernel_efficient_cpu, parent_list, top_scores_index, seq_lens, topk, steps,
                      draft_tokens, mode)
    for mine, sglang in zip(got, want):
        assert torch.equal(mine, sglang)
    if topk > 1:
        assert bool((got[2][2] != -1).any()), "the trees branch"


@interpreted
def test_fill_bonus_tokens(bodies):
    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens

    accept_tokens = torch.arange(100, 115).view(5, 3)
    accept_lens = torch.tensor([1, 3, 2, 3, 1], dtype=torch.int32)
    want, got = torch.zeros(5, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)
    fill_bonus_tokens[(5,)](accept_tokens, accept_lens, want, 3)
    bodies.fill_bonus_tokens_cpu(accept_tokens, accept_lens, got, 3)
    assert torch.equal(got, want) and got.tolist() == [100, 105, 107, 111, 112]


def test_stand_in_exposes_the_eagle_bodies():
    import sgl_kernel

    for name in ("assign_draft_cache_locs_contiguous_cpu", "build_tree_kernel_efficient_cpu", "fill_bonus_tokens_cpu"):
        assert getattr(sgl_kernel, name).__module__ == "sgl_kernel.eagle_bodies"


def test_bodies_match_sglang_triton_kernels_in_the_interpreter():
    if INTERPRET:
        pytest.skip("already running in the interpreter")
    run_in_interpreter(__file__, "(in_the_interpreter or server)")


# ----------------------------------------------------------------------------- draft decode attention


class KVPool:
    """The slice of SGLang's KV pool that TorchNativeAttnBackend uses: one layer, [slots, H, Dh]."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def set_kv_buffer(self, layer, loc, k, v):
        self.keys[loc.loc.long()] = k.reshape(len(k), *self.keys.shape[1:])
        self.values[loc.loc.long()] = v.reshape(len(v), *self.values.shape[1:])

    def get_key_buffer(self, layer_id):
        return self.keys

    def get_value_buffer(self, layer_id):
        return self.values


def test_draft_decode_table():
    from sglang_oea.cpu.eagle import draft_decode_table

    req_to_token = torch.arange(3 * 20).view(3, 20).int()
    table, prefix = draft_decode_table(req_to_token, torch.tensor([2, 0]), torch.tensor([3, 5]), topk=2, num_steps=2)
    assert prefix.tolist() == [3, 3, 5, 5]
    assert table[0, :5].tolist() == [40, 41, 42, 43, 44]  # request 2: prefix 40..42, branch 0's slots 43, 44
    assert table[1, :5].tolist() == [40, 41, 42, 45, 46]  # branch 1's slots follow branch 0's
    assert table[3, :7].tolist() == [0, 1, 2, 3, 4, 7, 8]


@pytest.mark.parametrize("step", [0, 2])
def test_draft_step_attention_matches_brute_force(step):
    """Step `step` of a 2-branch, 4-step draft: each row attends its request's prefix and its own
    branch's first step + 1 slots, and writes its K/V to the slot it is given."""
    from sglang_oea.cpu.eagle import TorchNativeDraftSteps

    gen = torch.Generator().manual_seed(step)
    batch, topk, steps, heads, kv_heads, dim, slots = 2, 2, 4, 4, 2, 8, 64
    pool = KVPool(torch.randn(slots, kv_heads, dim, generator=gen), torch.randn(slots, kv_heads, dim, generator=gen))
    req_to_token = torch.randperm(slots, generator=gen)[:3 * 20].view(3, 20).int()
    runner = types.SimpleNamespace(device="cpu", token_to_kv_pool=pool,
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token))
    rows, seq_lens = torch.tensor([1, 2]), torch.tensor([5, 9])
    draft = TorchNativeDraftSteps(runner, topk, steps)
    batch_info = types.SimpleNamespace(req_pool_indices=rows, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
                                       encoder_lens=None, out_cache_loc=None)
    draft.init_forward_metadata(batch_info)
    # this step's slot of branch t of request b, as draft_forward hands them (per_step_draft_out_cache_loc)
    written = torch.stack([req_to_token[r, s + t * steps + step] for r, s in zip(rows, seq_lens) for t in range(topk)])
    batch_info.out_cache_loc = written.long()
    layer = types.SimpleNamespace(tp_q_head_num=heads, tp_k_head_num=kv_heads, qk_head_dim=dim, v_head_dim=dim,
                                  layer_id=0, scaling=dim ** -0.5, is_cross_attention=False, sliding_window_size=None)
    q = torch.randn(batch * topk, heads * dim, generator=gen)
    k, v = (torch.randn(batch * topk, kv_heads, dim, generator=gen) for _ in range(2))
    out = draft.attn_backends[step].forward_decode(q, k, v, layer, batch_info).view(batch * topk, heads, dim)
    assert torch.equal(pool.keys[written.long()], k) and torch.equal(pool.values[written.long()], v)
    for b, (r, length) in enumerate(zip(rows.tolist(), seq_lens.tolist())):
        for t in range(topk):
            start = length + t * steps
            seen = torch.cat([req_to_token[r, :length], req_to_token[r, start:start + step + 1]]).long()
            for h in range(heads):
                keys, values = pool.keys[seen, h // (heads // kv_heads)], pool.values[seen, h // (heads // kv_heads)]
                query = q.view(batch * topk, heads, dim)[b * topk + t, h]
                want = (keys @ query / math.sqrt(dim)).softmax(0) @ values
                torch.testing.assert_close(out[b * topk + t, h], want, rtol=1e-5, atol=1e-5)
