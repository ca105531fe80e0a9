"""End to end under speculative decoding: NGRAM on the real SGLang server (CPU engine, tiny model
with random weights).

NGRAM needs no draft model: the target decodes only in TARGET_VERIFY passes of requests x draft
tokens rows, which OEA routes. Two CPU-only helpers make it run here: the stand-in sgl_kernel's
plain-torch bodies for the speculative ops (cpu/stub/sgl_kernel/cpu_bodies.py) and the
`oea_cpu_harness` plugin's verify attention for the torch_native backend, which has none.

Two servers, one at a time: plain SGLang without speculative decoding or plugins (the greedy
reference), then one NGRAM server with OEA started at k0 = top-k (a no-op: SGLang's own routing)
that both tests share in order. Its greedy text equal to plain greedy decoding's shows at once that
the CPU verify path is sound and that OEA at k0 >= top-k changes nothing under speculation (either
fault alone would make them differ); then k0 4 is set live and routes the verify passes.
"""

import re

import pytest

pytestmark = pytest.mark.server

from test_server_e2e import (TOP_K, accept_lengths, complete, concurrent, greedy_texts, make_model, oea_value, scrape,
                             serve, set_live)

DRAFTS = 4
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(DRAFTS),
         "--max-total-tokens", "16384",  # a small KV pool: these servers share the machine
         "--speculative-ngram-capacity", "100000",  # the default 10M-entry corpus takes ~1.8 GiB
         "--decode-log-interval", "1")
APPLIED, SKIPPED = "sglang:oea_decode_steps_applied_total", "sglang:oea_decode_steps_skipped_total"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Real random weights: with SGLang's dummy weights no routing or attention change could move a
    greedy token (see tiny_model), and the identity tests below could not fail."""
    return make_model(str(tmp_path_factory.mktemp("spec") / "qwen3_moe"), "qwen3_moe", "--random-weights")


@pytest.fixture(scope="module")
def plain_texts(tmp_path_factory, model):
    """Plain SGLang's greedy texts: no speculative decoding, no plugin."""
    with serve(tmp_path_factory, model, plugins=False) as (base, _):
        return greedy_texts(base)


@pytest.fixture(scope="module")
def ngram_oea(tmp_path_factory, model):
    """(URL, log path): the NGRAM server with OEA started at k0 = top-k, min-batch 1."""
    flags = (*NGRAM, "--oea-k0", str(TOP_K), "--oea-min-batch", "1", "--enable-metrics")
    with serve(tmp_path_factory, model, *flags) as running:
        yield running


def test_cpu_verify_path_reproduces_plain_greedy_decoding(plain_texts, ngram_oea):
    """Greedy speculative decoding must give greedy decoding's text: the CPU verify path (stand-in
    ops, harness attention) is sound, and OEA at k0 = top-k is SGLang's own routing."""
    base, log = ngram_oea
    assert greedy_texts(base) == plain_texts
    lengths = accept_lengths(open(log).read())
    assert lengths and all(1 <= n <= DRAFTS for n in lengths)


def test_k0_4_set_live_routes_verify_passes(ngram_oea):
    """Then (the server's settings are still those it started with) k0 4 and min-batch 2 set live."""
    base, log = ngram_oea
    set_live(base, oea_k0=4, oea_min_batch=2)
    start = scrape(base)
    complete(base, "alone", 12, ignore_eos=True)  # verify passes of 1 request < min batch 2
    alone = scrape(base)
    results = concurrent(base, 6, 20)
    after = scrape(base)
    assert all(r["usage"]["completion_tokens"] == 20 for r in results)

    def delta(name, old, new, **labels):
        return oea_value(new, name, **labels) - oea_value(old, name, **labels)

    assert delta(SKIPPED, start, alone, mode="verify", reason="below_min_batch") >= 2
    assert delta(APPLIED, start, alone) == 0
    assert delta(APPLIED, alone, after, mode="verify") >= 3
    assert oea_value(after, APPLIED, mode="decode") == 0, "the target never decodes outside verify passes"
    # The kept router mass counts the verify passes' token rows, under mode "verify".
    lost, token_layers = "sglang:oea_router_mass_lost_total", "sglang:oea_routed_token_layers_total"
    assert delta(lost, alone, after, mode="verify", k0="4") > 0 and delta(token_layers, start, after, mode="verify") > 0
    assert oea_value(after, token_layers, mode="decode") == 0
    for layer in ("0", "1"):
        before = oea_value(after, "sglang:oea_active_experts_before", layer=layer)
        assert 4 <= oea_value(after, "sglang:oea_active_experts_after", layer=layer) < before
    assert 1 <= oea_value(after, "sglang:spec_accept_length") <= DRAFTS
    lengths = accept_lengths(open(log).read())
    assert lengths and all(1 <= n <= DRAFTS for n in lengths) and max(lengths) > 1
    text = open(log).read()
    assert "OEA no-op (k0 >= top-k)" in text and "verify=on" in text
    assert "settings k0=8 min_batch=1 max_batch=0 -> k0=4 min_batch=2 max_batch=0" in text
    assert "speculative NGRAM: verify passes routed (rows = requests x draft tokens)" in text
    assert re.search(r"Decode batch.*OEA k0=4: applied \d+/\d+ verify steps, experts/layer/step [\d.]+ -> [\d.]+", text)
