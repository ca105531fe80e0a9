"""The CPU stand-in's plain-torch sgl_kernel bodies (cpu/stub/sgl_kernel/cpu_bodies.py) against
SGLang's own Triton kernels for the same ops, run on CPU tensors by Triton's interpreter.

SGLang's CPU engine calls these ops under speculative decoding (NGRAM: KV-slot moves, draft-token
bookkeeping, greedy tree verification); on a GPU SGLang launches the Triton kernels instead. The
comparisons run in a TRITON_INTERPRET=1 child (Triton reads the variable once, at import).
"""

import os

import pytest
import torch

from oea_fixtures import run_in_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter child")
BATCH, DRAFTS = 5, 6  # odd sizes: requests, draft tokens per request


@pytest.fixture
def bodies():
    from sgl_kernel import cpu_bodies

    return cpu_bodies


def random_trees(gen, batch=BATCH, drafts=DRAFTS):
    """[B, D, D] bool ancestor masks (self included) of random trees in topological order."""
    mask = torch.zeros(batch, drafts, drafts, dtype=torch.bool)
    for b in range(batch):
        for i in range(drafts):
            mask[b, i, i] = True
            if i:
                mask[b, i] |= mask[b, int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def tree_links(bodies, mask, seq_lens):
    """(positions [B*D], retrieve_index, next_token, next_sibling [B, D]) from the stand-in."""
    batch, drafts = mask.shape[:2]
    out = [torch.zeros(batch * drafts, dtype=torch.int64)] + [torch.zeros(batch, drafts, dtype=torch.int64) for _ in range(3)]
    bodies.reconstruct_indices_from_tree_mask(mask.flatten(), seq_lens, *out, batch, drafts)
    return out


@interpreted
def test_copy_all_layer_kv_cache(bodies):
    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled

    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randn(23, 3, 8, generator=gen).to(dtype) for dtype in (torch.bfloat16, torch.float32)]
    copies = [b.clone() for b in buffers]
    tgt, src = torch.tensor([3, 9, 4, 0, 21]), torch.tensor([9, 3, 17, 0, 9])  # a swap, a fan-out, slot 0 onto itself

    def launch(bufs):
        ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
        return ptrs, torch.tensor([b.stride(0) * b.element_size() for b in bufs])

    ptrs, strides = launch(buffers)
    copy_all_layer_kv_cache_tiled[(len(buffers), 2)](ptrs, strides, tgt, src, 5, 8, BYTES_PER_TILE=64)
    bodies.copy_all_layer_kv_cache_cpu(*launch(copies), tgt, src)
    assert all(torch.equal(a, b) for a, b in zip(buffers, copies))


@interpreted
def test_assign_and_read_request_slots(bodies):
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    pool_len = 16
    rows, start, end = torch.tensor([2, 0, 3]), torch.tensor([1, 4, 0]), torch.tensor([4, 6, 3])
    slots = torch.arange(100, 108)
    want, got = torch.zeros(4, pool_len, dtype=torch.int32), torch.zeros(4, pool_len, dtype=torch.int32)
    assign_req_to_token_pool[(3,)](rows, want, start, end, slots, pool_len, 4)
    bodies.assign_req_to_token_pool_cpu(rows, got, start, end, slots, pool_len)
    assert torch.equal(got, want)
    want_locs, got_locs = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    assign_extend_cache_locs[(3,)](rows, want, start, end, want_locs, pool_len, 4)
    bodies.assign_extend_cache_locs_cpu(rows, want, start, end, got_locs, pool_len)
    assert torch.equal(got_locs, want_locs) and torch.equal(got_locs, slots)


@interpreted
@pytest.mark.parametrize("seed", range(3))
def test_reconstruct_tree_indices(bodies, seed):
    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton

    gen = torch.Generator().manual_seed(seed)
    mask, seq_lens = random_trees(gen), torch.randint(1, 30, (BATCH,), generator=gen)
    want = [torch.zeros(BATCH * DRAFTS, dtype=torch.int64)] + [torch.zeros(BATCH, DRAFTS, dtype=torch.int64) for _ in range(3)]
    reconstruct_indices_from_tree_mask_triton(mask.flatten(), seq_lens, *want, BATCH, DRAFTS)
    for got, expected in zip(tree_links(bodies, mask, seq_lens), want):
        assert torch.equal(got, expected)


@interpreted
@pytest.mark.parametrize("seed", range(4))
def test_verify_tree_greedy(bodies, seed):
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    gen = torch.Generator().manual_seed(seed)
    mask = random_trees(gen)
    _, retrieve, next_token, next_sibling = tree_links(bodies, mask, torch.zeros(BATCH, dtype=torch.int64))
    candidates = torch.randint(0, 3, (BATCH, DRAFTS), generator=gen)  # a small vocabulary: drafts often match
    target = torch.randint(0, 3, (BATCH, DRAFTS), generator=gen)
    outs = []
    for verify in (verify_tree_greedy_triton, bodies.verify_tree_greedy_cpu):
        out = (torch.zeros(BATCH * DRAFTS, dtype=torch.int64), torch.full((BATCH, 4), -1, dtype=torch.int64),
               torch.zeros(BATCH, dtype=torch.int32))
        verify(*out, candidates, retrieve, next_token, next_sibling, target)
        outs.append(out)
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)
    assert outs[1][2].sum() > 0, "some drafts were accepted"


@interpreted
def test_fill_accepted_slots(bodies):
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc

    accept_index = torch.tensor([[0, 2, -1], [3, -1, -1], [6, 7, 8]])
    slots = torch.arange(50, 59)
    want, got = torch.zeros(9, dtype=torch.int64), torch.zeros(9, dtype=torch.int64)
    fill_accept_out_cache_loc[(9,)](accept_index, slots, want, 16)
    bodies.fill_accept_out_cache_loc_cpu(accept_index, slots, got)
    assert torch.equal(got, want) and got[:6].tolist() == [50, 52, 53, 56, 57, 58]


def test_stand_in_keeps_raising_for_other_ops():
    import sgl_kernel
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    assert sgl_kernel.IS_SGLANG_OEA_STUB and reconstruct_indices_from_tree_mask.__module__ == "sgl_kernel.cpu_bodies"
    with pytest.raises(sgl_kernel.StubOpCalled, match="build_draft_decode_metadata_cpu was called"):
        sgl_kernel.build_draft_decode_metadata_cpu()


def test_bodies_match_sglang_triton_kernels_in_the_interpreter():
    if INTERPRET:
        pytest.skip("already running in the interpreter")
    run_in_interpreter(__file__, "in_the_interpreter")
