"""EAGLE with an MTP (nextn) draft on SGLang's CPU engine: the stand-in sgl_kernel's EAGLE bodies
(cpu_stub/sgl_kernel/eagle_bodies.py) against SGLang's own Triton kernels, the draft's decode
attention (sglang_oea.cpu_eagle) against a brute-force one, and one server: EAGLE with OEA armed,
on a tiny Glm4MoeForCausalLM with one nextn layer (real random weights), whose greedy text must
equal greedy decoding's without speculative decoding and whose draft passes OEA must leave alone.

The Triton comparisons run in a TRITON_INTERPRET=1 child (Triton reads the variable once, at import).
"""

import json
import math
import os
import re
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from oea_fixtures import run_in_interpreter
from test_server_e2e import make_model, oea_value, post, scrape, serve, transformers_greedy

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
    from sglang_oea.cpu_eagle import draft_decode_table

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
    from sglang_oea.cpu_eagle import TorchNativeDraftSteps

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


# ----------------------------------------------------------------------------- servers

DRAFTS = 4  # SGLang's default for Glm4Moe: 3 draft steps, top-1, 4 draft tokens (a chain)
EAGLE = ("--speculative-algorithm", "EAGLE", "--dtype", "float32", "--max-total-tokens", "8192",
         "--decode-log-interval", "1")
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300, 42, 17], [3, 3, 3, 3], [250, 251, 252, 253, 254, 255, 256, 257]]
GREEDY_TOKENS, CONCURRENT, CONCURRENT_TOKENS = 16, 8, 20
APPLIED, SKIPPED = "sglang:oea_decode_steps_applied_total", "sglang:oea_decode_steps_skipped_total"


def make_draftable(directory: str, scale: float = 0.1) -> None:
    """Reshape a random GLM checkpoint so that its MTP draft often agrees with the target.

    With plain random weights the draft almost never proposes the target's token, so every step
    accepts nothing and the accept paths (accepted KV slots, bonus tokens, draft extend over
    accepted tokens) never run. Here attention and MoE outputs are scaled by `scale`: the next
    token depends mostly on the current one (and still on the context, through them), and the MTP
    head's eh_proj passes on the embedding of the token it is given, so the draft predicts much
    as the target does.
    """
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    weights, hidden = load_file(path), cfg["hidden_size"]
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = (tensor.float() * scale).to(tensor.dtype)
    echo = torch.zeros(hidden, 2 * hidden)
    echo[:, :hidden] = torch.eye(hidden)
    weights[f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"] = echo.to(torch.bfloat16)
    save_file(weights, path)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    directory = make_model(str(tmp_path_factory.mktemp("eagle") / "glm4_moe_mtp"), "glm4_moe", "--nextn-layers", "1",
                           "--random-weights")
    make_draftable(directory)
    return directory


def generate(base, ids, max_tokens):
    params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return json.loads(post(base + "/generate", {"input_ids": ids, "sampling_params": params}))["output_ids"]


@pytest.fixture(scope="module")
def plain_ids(mtp_model):
    """Greedy ids without speculative decoding: transformers' (float32, the nextn layer unused).
    A plain SGLang server gives the same ids for these prompts; transformers saves a server start."""
    return transformers_greedy(mtp_model, PROMPTS, GREEDY_TOKENS)


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory, mtp_model):
    """One EAGLE server with OEA armed (k0 2 from 2 requests): greedy ids one request at a time
    (below the floor: SGLang's own routing), then concurrent requests (routed), /metrics around."""
    flags = (*EAGLE, "--oea-k0", "2", "--oea-min-batch", "2", "--enable-metrics")
    with serve(tmp_path_factory, mtp_model, *flags) as (base, log):
        start = scrape(base)
        greedy = [generate(base, ids, GREEDY_TOKENS) for ids in PROMPTS]
        alone = scrape(base)
        with ThreadPoolExecutor(CONCURRENT) as pool:
            prompts = [[10 + i, 20, 30 + i, 40] for i in range(CONCURRENT)]
            outputs = list(pool.map(lambda ids: generate(base, ids, CONCURRENT_TOKENS), prompts))
        after = scrape(base)
    return types.SimpleNamespace(greedy=greedy, outputs=outputs, start=start, alone=alone, after=after,
                                 log=open(log).read())


def accept_lengths(log):
    """SGLang's 'accept len' of every 'Decode batch' log line (one line per EAGLE step here)."""
    return [float(m) for m in re.findall(r"Decode batch.*?accept len: ([\d.]+)", log)]


@pytest.mark.server
def test_eagle_greedy_text_equals_plain_greedy_decoding(plain_ids, eagle_run):
    """Draft, verify, accept and draft extend on the CPU reproduce greedy decoding token for token."""
    assert eagle_run.greedy == plain_ids


@pytest.mark.server
def test_concurrent_requests_finish_with_all_their_tokens(eagle_run):
    assert [len(ids) for ids in eagle_run.outputs] == [CONCURRENT_TOKENS] * CONCURRENT


@pytest.mark.server
def test_oea_routes_the_targets_verify_passes_only(eagle_run):
    run = eagle_run

    def delta(name, old, new, **labels):
        return oea_value(new, name, **labels) - oea_value(old, name, **labels)

    assert delta(APPLIED, run.start, run.alone) == 0, "one request at a time stays below --oea-min-batch 2"
    lone_steps = len(PROMPTS) * (GREEDY_TOKENS - 1) // DRAFTS  # at least: every step accepts at most 4
    assert delta(SKIPPED, run.start, run.alone, mode="verify", reason="below_min_batch") >= lone_steps
    assert delta(APPLIED, run.alone, run.after, mode="verify") >= 3
    assert oea_value(run.after, APPLIED) == oea_value(run.after, APPLIED, mode="verify")
    assert oea_value(run.after, APPLIED, mode="decode") + oea_value(run.after, SKIPPED, mode="decode") == 0
    # Every EAGLE step runs one target verify pass and three draft passes (two draft decodes and a
    # draft extend); exactly the verify passes are counted, one per 'Decode batch' line.
    verify_steps = oea_value(run.after, APPLIED, mode="verify") + oea_value(run.after, SKIPPED, mode="verify")
    assert verify_steps == len(accept_lengths(run.log))
    for layer in ("0", "1"):
        before = oea_value(run.after, "sglang:oea_active_experts_before", layer=layer)
        assert 2 <= oea_value(run.after, "sglang:oea_active_experts_after", layer=layer) < before
    assert "sglang-oea rank 0: OEA on, k0=2 min_batch=2" in run.log and "verify=on" in run.log
    assert "speculative EAGLE: verify passes routed (rows = requests x draft tokens)" in run.log


@pytest.mark.server
def test_sglang_reports_accept_lengths_above_one(eagle_run):
    lengths = accept_lengths(eagle_run.log)
    assert lengths and all(1 <= n <= DRAFTS for n in lengths) and max(lengths) > 1
    assert 1 <= oea_value(eagle_run.after, "sglang:spec_accept_length") <= DRAFTS
