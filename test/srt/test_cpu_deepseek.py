"""DeepseekV3ForCausalLM, GLM-5's architecture family, on the real SGLang server on the CPU engine:
the trained checkpoint benchmark/oea/models/deepseek_v3_stdlib (train_moe.py --arch deepseek_v3:
MLA with q_lora_rank, a first dense layer, 256 routed experts top-8 with sigmoid scores and a
learned correction bias, one shared expert, routed scaling factor 2.5, yarn rope, and one MTP
layer). transformers' float32 greedy decoding of held-out prompts is the reference throughout.

Two servers, one at a time (2 cores), each shared by the assertions it can serve; OEA settings
change between assertions through /set_internal_state:
- TP=1 with EAGLE, the checkpoint's own MTP layer as the draft (DeepseekV3ForCausalLMNextN), and
  --disable-shared-experts-fusion: the shared expert runs as its own MLP and the top-k holds the 8
  routed columns only, as GLM-5-NVFP4 is served on RTX PRO 6000 (SM120), MTP included. SGLang's
  routed-expert capture is on (--enable-return-routed-experts): for one request, the experts
  returned for every decode position are those its verify passes ran, the router's with OEA off
  and OEA's at k0=1, as --oea-dump-router-logits recorded them, and OEA's are the definition's
  (sglang_oea.reference) over the 8 routed columns. Speculative greedy output equals
  transformers' with OEA at k0 >= top-k and off; k0=1 changes it; the OpenAI endpoints answer;
  under concurrent requests OEA applies in the target's verify passes only, never in the draft's
  passes nor in draft extend, and SGLang's accept length stays between 1 and the draft tokens.
  Then the operator's trial (benchmark/oea/trial/trial.py) against the same server, as small as it
  can be while going through every step: the preflight, one throughput block, the paired
  accept-length probe, quality_ab, and the restore of the k0 it found.
- TP=2, shared expert fused into the routed top-k (--enforce-shared-experts-fusion), no
  speculative decoding: transformers' greedy output at k0 >= top-k and off, k0=1 changes it, then
  OEA applied under load with both ranks' routing compared every step.

The harness hooks these servers need are unit-tested here too: MLA on the `torch_native` backend
(sglang_oea/cpu/mla.py; the servers and transformers' tokens are what show it right) and the
routed-expert capture's host buffer, unpinned on the CPU (sglang_oea/cpu/capture.py).
"""

import base64
import json
import os
import re
import time
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from oea_fixtures import marked_processes

from test_server_e2e import (TRAINED_DIR, accept_lengths, complete, concurrent, greedy_ids, heldout_prompts,
                             oea_value, post, scrape, serve, set_live, transformers_greedy)

MODEL = os.path.join(TRAINED_DIR, "deepseek_v3_stdlib")
TOP_K, NUM_EXPERTS, MOE_LAYERS = 8, 256, ("1", "2", "3")  # layer 0 is dense
LAYERS = 4  # num_hidden_layers: SGLang returns routed experts for every layer, zeros for the dense one
FP32 = ("--dtype", "float32")
METRICS = ("--enable-metrics", "--decode-log-interval", "1")
DRAFTS = 4  # 3 MTP draft steps, top-1: a chain of 4 draft tokens per request and step
EAGLE = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(DRAFTS - 1), "--speculative-eagle-topk",
         "1", "--speculative-num-draft-tokens", str(DRAFTS), "--max-total-tokens", "8192")
APPLIED, SKIPPED = "sglang:oea_decode_steps_applied_total", "sglang:oea_decode_steps_skipped_total"


@pytest.fixture(scope="module")
def deepseek():
    """{"prompts", "ids"}: held-out prompts and transformers' float32 greedy ids for them."""
    prompts = heldout_prompts(MODEL)
    return {"prompts": prompts, "ids": transformers_greedy(MODEL, prompts)}


def check_identity_then_change(base, deepseek):
    """Greedy ids one request at a time: transformers' at k0 >= top-k and with OEA off; k0=1 at
    min-batch 1 (each token keeps its own best expert and borrows from its pass) moves them, so the
    identity checks can fail."""
    for k0 in (TOP_K, 0):
        set_live(base, oea_k0=k0, oea_min_batch=1)
        assert greedy_ids(base, deepseek["prompts"]) == deepseek["ids"], k0
    set_live(base, oea_k0=1)
    assert greedy_ids(base, deepseek["prompts"]) != deepseek["ids"]


def fake_mla_layer(backend):
    return types.SimpleNamespace(current_attention_backend=backend)


@pytest.mark.parametrize("chosen", ["MHA", "MHA_CHUNKED_KV", "MHA_ONE_SHOT"])
def test_torch_native_runs_mla_absorbed(chosen):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from sglang_oea.cpu.mla import absorbed_on_torch_native

    original = lambda attn, batch: AttnForwardMethod[chosen]  # noqa: E731
    assert absorbed_on_torch_native(original, fake_mla_layer("torch_native"), None) == AttnForwardMethod.MLA
    assert absorbed_on_torch_native(original, fake_mla_layer("triton"), None) == AttnForwardMethod[chosen]
    mla = lambda attn, batch: AttnForwardMethod.MLA  # noqa: E731
    assert absorbed_on_torch_native(mla, fake_mla_layer("torch_native"), None) == AttnForwardMethod.MLA


def test_routed_expert_capture_gets_an_unpinned_host_buffer_on_the_cpu():
    """The harness hook that lets --enable-return-routed-experts start on the CPU: SGLang's host
    allocation, asked for pinned memory as the capture asks, with pin_memory turned off."""
    import torch
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator, alloc_with_host_register

    from sglang_oea.cpu.capture import unpinned

    args, kwargs = unpinned((5, LAYERS, TOP_K), dtype=torch.int32, device="cpu", pin_memory=True,
                            allocator=HostTensorAllocator())
    assert alloc_with_host_register(*args, **kwargs).shape == (5, LAYERS, TOP_K)
    assert unpinned((5,), torch.int32, "cpu", True, None) == (((5,), torch.int32, "cpu", False, None), {})


# ----------------------------------------------------------------------------- TP=1, EAGLE with the MTP draft


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory, deepseek):
    """One EAGLE server with OEA armed, the shared expert unfused and routed-expert capture on: one
    request's returned experts with OEA off and at k0=1 (first, while the router dump records its
    first 32 routed steps), the identity checks, the endpoints, then k0 2 from 2 requests: a lone
    request (below the floor), then 8 concurrent ones, /metrics around; then the trial (run_the_trial),
    the log kept up to its first change."""
    dump = str(tmp_path_factory.mktemp("dump"))
    flags = (*FP32, *METRICS, *EAGLE, "--disable-shared-experts-fusion", "--enable-return-routed-experts",
             "--oea-dump-router-logits", dump, "--oea-k0", str(TOP_K), "--oea-min-batch", "1")
    with serve(tmp_path_factory, MODEL, *flags) as (base, log):
        returned = {k0: returned_experts(base, dump, deepseek["prompts"][0], k0) for k0 in (0, 1)}
        check_identity_then_change(base, deepseek)
        endpoints = check_openai_endpoints(base)
        set_live(base, oea_k0=2, oea_min_batch=2)
        start = scrape(base)
        complete(base, "alone", 16, ignore_eos=True)
        alone = scrape(base)
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda ids: complete(base, ids, 20, ignore_eos=True), deepseek["prompts"] * 2))
        after = scrape(base)
        trial = run_the_trial(base, tmp_path_factory.mktemp("trial"), deepseek)
    text = open(log).read()
    # The log up to the trial's first settings change (the scheduler logs it at the pass that applies it,
    # before that pass's 'Decode batch' line): the passes that the counters in `after` saw.
    cut = text.find("settings k0=2 min_batch=2 max_batch=0 -> ")
    trial.cut = cut
    return types.SimpleNamespace(outputs=outputs, start=start, alone=alone, after=after,
                                 log=text if cut < 0 else text[:cut], endpoints=endpoints, returned=returned,
                                 trial=trial)


def returned_experts(base, dump, prompt, k0):
    """One request alone at `k0` (min-batch 1), its routed experts returned by SGLang.

    Returns a namespace: decode, [n, 3, K] int64, the experts SGLang returned for the request's
    decode positions (MoE layers 1-3); passes, one record per verify pass of the request, in order,
    as --oea-dump-router-logits wrote it: logits [D, N], router and oea ids [D, 3, K] (oea None
    where OEA left the pass alone), the correction biases [3, N]. The dump files new since the
    request began are its passes: nothing else runs on the server meanwhile.
    """
    import torch

    set_live(base, oea_k0=k0, oea_min_batch=1)
    before = set(os.listdir(dump))
    request = {"input_ids": prompt, "return_routed_experts": True,
               "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    meta = json.loads(post(base + "/generate", request))["meta_info"]
    # SGLang's encoding: base64 of int32 [prompt + output - 1, layers, K], one row per token fed in.
    experts = torch.frombuffer(bytearray(base64.b64decode(meta["routed_experts"])), dtype=torch.int32)
    experts = experts.view(-1, LAYERS, TOP_K).long()
    steps = sorted({name.split("_")[1] for name in set(os.listdir(dump)) - before})
    assert len(steps) == meta["spec_verify_ct"], "one dump step per verify pass of the request"
    passes = [dumped_pass(dump, step) for step in steps]
    return types.SimpleNamespace(decode=experts[len(prompt):, 1:], passes=passes)


def dumped_pass(dump, step):
    """The router dump of one verify pass (see returned_experts), its MoE layers stacked."""
    import torch

    records = [torch.load(os.path.join(dump, f"rank0_{step}_layer{int(layer):03d}.pt")) for layer in MOE_LAYERS]
    oea = None if records[0]["oea_ids"] is None else torch.stack([r["oea_ids"] for r in records], 1).long()
    return types.SimpleNamespace(logits=[r["router_logits"] for r in records], bias=[r["correction_bias"] for r in records],
                                 router=torch.stack([r["router_ids"] for r in records], 1).long(), oea=oea)


def accepted_rows(passes, rows):
    """True when `rows` ([n, ...]) are, in order, the rows the verify passes kept: a prefix of each
    pass's rows ([D, ...]: its first row, the token it verifies from, up to all D draft rows), the
    last pass cut where the request ended. Searches every split, so an ambiguous one cannot fail it."""
    import torch

    def fits(p, pos):
        if pos == len(rows) or p == len(passes):
            return pos == len(rows) and p == len(passes)
        for kept in range(1, min(len(passes[p]), len(rows) - pos) + 1):
            if not torch.equal(passes[p][kept - 1], rows[pos + kept - 1]):
                return False
            if fits(p + 1, pos + kept):
                return True
        return False

    return fits(0, 0)


def reference_oea_ids(one_pass, k0):
    """OEA's ids for a dumped verify pass by the definition (sglang_oea.reference), from its logits
    alone: the router's own top-K of sigmoid + bias scores (one group), then OEA over all K of them
    (no shared-expert column). Returns [D, 3, K] int64."""
    import torch

    from sglang_oea.reference import opportunistic_topk
    from sglang_oea.routing import RouterSpec, score_experts

    layers = []
    for logits, bias in zip(one_pass.logits, one_pass.bias):
        selection, _ = score_experts(logits, RouterSpec("sigmoid", correction_bias=bias))
        layers.append(opportunistic_topk(selection, selection.topk(TOP_K, dim=1).indices, k0))
    return torch.stack(layers, 1)


def check_openai_endpoints(base):
    """Completions, chat and a streamed completion through the EAGLE server."""
    assert complete(base, "hello", 8, ignore_eos=True)["usage"]["completion_tokens"] == 8
    chat_request = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
    chat = json.loads(post(base + "/v1/chat/completions", chat_request))
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] > 0
    stream_request = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
    stream = post(base + "/v1/completions", stream_request)
    assert stream.count("data: ") >= 3 and stream.rstrip().endswith("data: [DONE]")
    return True


@pytest.mark.server
def test_eagle_serves_the_trained_checkpoint_identically_with_oea_off_or_a_no_op(eagle_run):
    """Reached only when check_identity_then_change and the endpoints passed inside the fixture."""
    assert eagle_run.endpoints
    text = eagle_run.log
    assert f"N={NUM_EXPERTS} top-k={TOP_K} routing=sigmoid+bias" in text
    # The shared expert unfused: the capture's device buffer holds K columns per layer (fused: K + 1).
    assert re.search(rf"DeviceCache\[routed_experts\] allocated: shape=\(\d+, {LAYERS}, {TOP_K}\)", text)
    assert "Shared experts fusion optimization enabled" not in text
    assert "speculative EAGLE: verify passes routed (rows = requests x draft tokens)" in text


@pytest.mark.server
def test_returned_experts_are_those_each_verify_pass_ran(eagle_run):
    """--enable-return-routed-experts with OEA: for every decode position SGLang returns the ids
    the MoE ran for that token, the router's own with OEA off and OEA's at k0=1, row for row as
    the router dump recorded them for the same verify passes (each pass keeps its accepted rows)."""
    off, on = eagle_run.returned[0], eagle_run.returned[1]
    assert all(p.oea is None for p in off.passes) and all(p.oea is not None for p in on.passes)
    assert accepted_rows([p.router for p in off.passes], off.decode)
    assert accepted_rows([p.oea for p in on.passes], on.decode)
    # OEA changed them, so the two checks above can fail.
    assert not accepted_rows([p.router for p in on.passes], on.decode)
    for returned in (off.decode, on.decode):
        assert all(len(set(row.tolist())) == TOP_K for row in returned.reshape(-1, TOP_K))
        assert 0 <= int(returned.min()) and int(returned.max()) < NUM_EXPERTS


@pytest.mark.server
def test_oea_routes_the_unfused_top_k_as_defined(eagle_run):
    """With the shared expert unfused, OEA routes all 8 columns of the top-k as routed experts: the
    experts that ran at k0=1 (as SGLang returned them) are the definition's for each verify pass's
    router logits."""
    on = eagle_run.returned[1]
    assert accepted_rows([reference_oea_ids(one_pass, 1) for one_pass in on.passes], on.decode)


@pytest.mark.server
def test_concurrent_requests_finish_with_all_their_tokens(eagle_run):
    assert [r["usage"]["completion_tokens"] for r in eagle_run.outputs] == [20] * 8


@pytest.mark.server
def test_oea_routes_the_targets_verify_passes_only(eagle_run):
    run = eagle_run

    def delta(name, old, new, **labels):
        return oea_value(new, name, **labels) - oea_value(old, name, **labels)

    assert delta(APPLIED, run.start, run.alone) == 0, "one request at a time stays below --oea-min-batch 2"
    assert delta(SKIPPED, run.start, run.alone, mode="verify", reason="below_min_batch") >= 15 // DRAFTS
    assert delta(APPLIED, run.alone, run.after, mode="verify") >= 3
    assert oea_value(run.after, APPLIED) == oea_value(run.after, APPLIED, mode="verify")
    assert oea_value(run.after, APPLIED, mode="decode") + oea_value(run.after, SKIPPED, mode="decode") == 0
    # Every EAGLE step runs one target verify pass and three draft passes (two draft decodes and a
    # draft extend); exactly the verify passes are counted, one per 'Decode batch' line.
    verify_steps = oea_value(run.after, APPLIED, mode="verify") + oea_value(run.after, SKIPPED, mode="verify")
    assert verify_steps == len(accept_lengths(run.log))
    for layer in MOE_LAYERS:
        before = oea_value(run.after, "sglang:oea_active_experts_before", layer=layer)
        assert 2 <= oea_value(run.after, "sglang:oea_active_experts_after", layer=layer) < before
    assert re.search(r"Decode batch.*OEA k0=2: applied \d+/\d+ verify steps", run.log)


@pytest.mark.server
def test_the_trained_draft_is_accepted(eagle_run):
    """SGLang's accept length, per step and as its gauge: between 1 and the draft tokens, and above
    1 on average (the MTP layer learned to predict the token after next)."""
    lengths = accept_lengths(eagle_run.log)
    assert lengths and all(1 <= n <= DRAFTS for n in lengths)
    assert sum(lengths) / len(lengths) > 1.1
    assert 1 <= oea_value(eagle_run.after, "sglang:spec_accept_length") <= DRAFTS


# ----------------------------------------------------------------------------- the operator's trial under EAGLE

TRIAL_K0, TRIAL_C = 1, 2  # one arm; C=2 is where the gate the fixture left (min-batch 2) first opens
TRIAL_FLAGS = ["--k0", str(TRIAL_K0), "--concurrency", str(TRIAL_C), "--input-len", "32", "--output-len", "16",
               "--prompts-per-concurrency", "2", "--min-prompts", "4", "--warmup-prompts", "0", "--max-repeats", "1",
               "--accept-prompts", "4", "--budget-minutes", "0.1", "--quality", "quality-ab"]


def run_the_trial(base, out, deepseek):
    """benchmark/oea/trial/trial.py, in this process, against the EAGLE server as eagle_run leaves it
    (k0 2 in force, min-batch 2, no cap), the smallest trial that goes through every step: preflight,
    one throughput block at C=2, the paired accept-length probe at its floor (4 prompts; the 6-second
    budget stops it there unless its first round decides), quality_ab at C=2 on the held-out prompts
    with transformers' greedy ids as reference_ids, the restore. Returns a namespace: rc, out, seconds,
    state (the server's OEA state after the trial), left (processes the trial started still alive)."""
    from trial import trial

    prompts = out / "reference.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "reference_ids": ids}) + "\n"
                               for p, ids in zip(deepseek["prompts"], deepseek["ids"])))
    mark = f"OEA_TRIAL_TEST_{os.getpid()}_{id(out)}"  # in the environment of every process the trial starts
    os.environ[mark] = "1"
    try:
        t0 = time.time()
        rc = trial.main(["--url", base, *TRIAL_FLAGS, "--quality-prompts", str(prompts), "--quality-max-tokens",
                         str(len(deepseek["ids"][0])), "--out-dir", str(out / "out")])
        seconds = time.time() - t0
    finally:
        del os.environ[mark]
    print(f"the trial under EAGLE took {seconds:.0f} s")
    state = json.loads(urllib.request.urlopen(base + "/server_info", timeout=30).read())["internal_states"][0]["oea"]
    return types.SimpleNamespace(rc=rc, out=out / "out", seconds=seconds, state=state, left=marked_processes(mark))


@pytest.mark.server
def test_the_trial_runs_through_the_accept_length_probe_under_eagle(eagle_run, deepseek):
    """The operator's trial on a real EAGLE server: SGLang's limits and the draft tokens read by the
    preflight, the throughput table's accept length per arm (context), the paired probe through
    SGLang's per-request figures (it decides: the verdict's cell and the recommendation use it),
    quality_ab at C=2 where the gate opens, k0 2 put back, exit 0, nothing left running."""
    run = eagle_run.trial
    result = json.loads((run.out / "results.json").read_text())
    assert run.rc == 0 and result["status"] == "done", result["status"]
    assert run.cut > 0, "the trial's first settings change is in the server log"
    # the restore: the k0 the trial found (2, not the 0 of an armed-and-off server), in force, by the trial
    assert result["restored"] == {"oea_k0": 2} and result["restore"]["by"] == "the trial"
    assert (run.state["k0"], run.state["min_batch"]) == (2, 2) and "pending" not in run.state
    assert run.left == []  # the bench driver and the guard are gone

    pre = result["preflight"]
    assert (pre["speculative"], pre["rows_per_request"], pre["original"]["oea_k0"]) == ("EAGLE", DRAFTS, 2)
    assert any("each replica runs at most 48 requests at once (SGLang's default under speculative decoding"
               in line for line in pre["lines"])
    (gate,) = pre["gates"]
    assert gate["open"] and gate["rows"] == TRIAL_C * DRAFTS

    # throughput: one block, both arms; SGLang's accept length per arm, pooled over the runs (context)
    arms = {a["arm"]: a for a in result["arms"]}
    assert set(arms) == {"baseline", f"oea-k0={TRIAL_K0}"} and all(a["repeats"] == 1 for a in arms.values())
    assert all(1 <= a["accept_length"] <= DRAFTS for a in arms.values())
    assert arms["baseline"]["applied_share"] == 0 and arms[f"oea-k0={TRIAL_K0}"]["applied_share"] > 0

    # the paired probe: per request, OEA against off on the same prompts, at least its floor
    probe = result["accept_length_probe"][str(TRIAL_C)][str(TRIAL_K0)]
    assert probe["floor"] == 2 * TRIAL_C and probe["n"] == probe["prompts"] >= probe["floor"]
    assert 1 <= probe["off"] <= DRAFTS and 1 <= probe["oea"] <= DRAFTS
    assert probe["low"] <= probe["change"] <= probe["high"]
    assert probe["change"] == pytest.approx((probe["oea"] - probe["off"]) / probe["off"])
    # k0=1 moves the target's tokens away from those its MTP draft learned to predict (the draft is left
    # alone): fewer drafts accepted. Pairs taken the wrong way round would show a gain.
    assert probe["change"] < 0 and probe["oea"] < probe["off"]
    assert probe["sized"] in (f"cleared the bound after {probe['prompts']} prompts",
                              f"the budget ended at {probe['prompts']} prompts, the interval not clear of the bound")
    (cell,) = result["cells"]
    assert cell["accept_length"] == probe  # the probe decides, not the table
    shown_worse = f"accept length not shown non-inferior at C={TRIAL_C}" in result["recommendation"]["problems"][
        str(TRIAL_K0)]
    assert shown_worse == (not probe["non_inferior"])

    # quality through quality_ab, once: C=2 is both where the gate opens and the largest swept C
    (quality,) = result["quality"]
    q = quality["per_k0"][str(TRIAL_K0)]
    assert (quality["tool"], quality["metric"], quality["concurrency"]) == ("quality-ab", "reference match", TRIAL_C)
    assert quality["why"].startswith("the smallest concurrency at which the gate opens (min_batch 2 requests, "
                                     f"{DRAFTS} rows each)")
    assert q["n"] == len(deepseek["prompts"]) and q["oea_applied"]["applied_steps"] > 0
    assert q["low"] <= q["delta"] <= q["high"] and 0 < q["baseline"] <= 1
    assert q["delta"] < 0  # k0=1 moves greedy ids away from transformers' (check_identity_then_change, batch 1)
    assert list(run.out.glob(f"quality/quality_ab_k0_{TRIAL_K0}_c{TRIAL_C}/*"))

    markdown = (run.out / "results.md").read_text()
    for text in (f"accept length: 2 arms of at least {2 * TRIAL_C} prompts at C={TRIAL_C} (",
                 "| accept len (context) |", "## Accept length: the paired probe decides",
                 "The throughput table's accept length is context", "accept length, OEA vs off (paired probe)",
                 f"- C={TRIAL_C}, k0={TRIAL_K0}: off {probe['off']:.2f}, OEA {probe['oea']:.2f} over {probe['n']} "
                 "prompts", "Settings put back: {\"oea_k0\": 2}"):
        assert text in markdown, text
    assert set(result["budget"]["phases"]) == {"throughput", "accept length", "quality"}


# ----------------------------------------------------------------------------- TP=2, shared expert fused


@pytest.mark.server
def test_tp2_with_a_fused_shared_expert_matches_and_ranks_agree(tmp_path_factory, deepseek):
    """The shared expert fused into the top-k as its ninth slot (SGLang's GPU layout for DeepSeek-V3;
    off by default on the CPU) at --tp 2: transformers' greedy tokens at k0 >= top-k and off, k0=1
    changes them; then k0=2 at min-batch 2 under concurrent load, with the ranks' routing compared
    every step."""
    flags = (*FP32, *METRICS, "--tp", "2", "--enforce-shared-experts-fusion", "--oea-check-ranks", "1",
             "--oea-k0", str(TOP_K), "--oea-min-batch", "1")
    with serve(tmp_path_factory, MODEL, *flags) as (base, log):
        check_identity_then_change(base, deepseek)
        set_live(base, oea_k0=2, oea_min_batch=2)
        assert all(r["usage"]["completion_tokens"] == 20 for r in concurrent(base, 6, 20))
        metrics = scrape(base)
        assert greedy_ids(base, deepseek["prompts"][:1]) == deepseek["ids"][:1], "batch 1 is below min-batch"
    for rank in ("0", "1"):
        assert oea_value(metrics, APPLIED, tp_rank=rank, k0="2") >= 10
        assert oea_value(metrics, "sglang:oea_rank_checks_total", tp_rank=rank) >= 10
    text = open(log).read()
    assert "Shared experts fusion optimization enabled." in text
    assert "routed different experts" not in text
