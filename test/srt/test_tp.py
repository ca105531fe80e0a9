"""Tensor parallel on the real server: `cpu_serve --tp 2` runs two SGLang scheduler ranks on the
CPU engine (their all-reduces go over gloo). The trained Qwen3-MoE checkpoint (benchmark/oea/models),
and a tiny dummy-weight model for the fault-injection test; the sigmoid + correction-bias family
at TP=2 is test_cpu_deepseek.py's (DeepSeek-V3, GLM-5's MoE block, fused shared expert).

What must hold at TP=2, on one server (float32): under concurrent load with OEA on, both ranks
see the same router logits and choose the same experts at every recorded step and layer, export
the same counts, and the rank check (--oea-check-ranks) passes; live changes land on both ranks at
the same step; with OEA set off or to a no-op live, greedy outputs equal transformers' float32
greedy decoding (which plain SGLang reproduces on this checkpoint, test_server_e2e.py). The output
comparisons use held-out prompts on trained weights, where routing moves greedy tokens, and k0=1
shows that they can fail. Then one rank's routing checksum is made to diverge (a fault loaded into
every server process, switched on by a file): the next rank check stops the server. A server
started without --oea-k0 installs no hooks at any TP size (test_server_e2e.py, TP=1). One server
for the whole file (a TP=2 start costs some 90 s on 2 cores), shared by both tests in order.
"""

import json
import os
import re
import textwrap
import time
import urllib.request

import pytest
import torch

from test_live_settings import changes_logged
from test_server_e2e import (FP32, TOP_K, concurrent, greedy_ids, heldout_prompts, models, oea_value,  # noqa: F401
                             post, scrape, serve, set_live, transformers_greedy)

pytestmark = pytest.mark.server

TP = ("--tp", "2")
RANKS = ("0", "1")


def rank_lines(log, pattern):
    """{rank: number of log lines matching pattern} for the lines SGLang prefixed with 'TP<rank>'.
    log: a log file's path, or its lines."""
    counts = {}
    for line in open(log) if isinstance(log, str) else log:
        found = re.search(r"\bTP(\d+)\]", line)
        if found and re.search(pattern, line):
            counts[found.group(1)] = counts.get(found.group(1), 0) + 1
    return counts


@pytest.fixture(scope="module")
def reference(models):
    """{"prompts", "ids"}: held-out prompts and transformers' float32 greedy ids for them."""
    model = models["qwen3_moe_trained"]
    prompts = heldout_prompts(model)
    return {"prompts": prompts, "ids": transformers_greedy(model, prompts)}


def dumps_by_rank(directory):
    """{(step, layer): {rank: record}} from a --oea-dump-router-logits directory."""
    out = {}
    for name in os.listdir(directory):
        rank, step, layer = re.match(r"rank(\d+)_step(\d+)_layer(\d+)\.pt$", name).groups()
        out.setdefault((int(step), int(layer)), {})[rank] = torch.load(os.path.join(directory, name))
    return out


def check_ranks_agree(base, log, dump, layers):
    """Both ranks: identical dumps at every recorded step and layer, identical OEA metrics."""
    records = dumps_by_rank(dump)
    assert records and all(set(ranks) == set(RANKS) for ranks in records.values())
    assert {layer for _, layer in records} == set(range(layers))
    rewritten = 0
    for key, ranks in records.items():
        zero, one = ranks["0"], ranks["1"]
        assert torch.equal(zero["router_logits"], one["router_logits"]), key
        assert torch.equal(zero["router_ids"], one["router_ids"]), key
        assert (zero["oea_ids"] is None) == (one["oea_ids"] is None), key
        if zero["oea_ids"] is not None:
            assert torch.equal(zero["oea_ids"], one["oea_ids"]), key
            rewritten += int(not torch.equal(zero["oea_ids"].sort().values, zero["router_ids"].sort().values))
    assert rewritten > 0, "no recorded step where OEA changed an expert"

    metrics = scrape(base)
    per_rank = {rank: {(n, frozenset(kv for kv in ls if kv[0] != "tp_rank")): v for (n, ls), v in metrics.items()
                       if n.startswith("sglang:oea_") and ("tp_rank", rank) in ls} for rank in RANKS}
    assert per_rank["0"] and per_rank["0"] == per_rank["1"]
    assert oea_value(metrics, "sglang:oea_decode_steps_applied_total", tp_rank="0") >= 10
    assert oea_value(metrics, "sglang:oea_rank_checks_total", tp_rank="0") >= 10
    assert oea_value(metrics, "sglang:oea_router_mass_lost_total", tp_rank="0") > 0, "kept mass compared, too"
    assert "routed different experts" not in open(log).read()


# Loaded by every server process through PYTHONPATH: once the file FAULT_SWITCH names exists, the
# last rank's layer-0 checksum, as every rank gathers it, is off by one, as if that rank had routed
# one expert differently (column 0 of what RankCheck.gather returns is each rank's routed step,
# column 1 layer 0's checksum). A file, not a flag: the same server runs the passing checks first.
FAULT_SWITCH = "SGLANG_OEA_TEST_DIVERGE_FILE"
FAULT = textwrap.dedent(f"""
    import os
    import sglang_oea.rank_check as rank_check

    gather = rank_check.RankCheck.gather
    switch = os.environ.get({FAULT_SWITCH!r}, "")

    def gather_with_a_diverged_rank(self, local):
        gathered = gather(self, local)
        if switch and os.path.exists(switch):
            gathered[-1, 1] += 1
        return gathered

    rank_check.RankCheck.gather = gather_with_a_diverged_rank
""")


LOAD_FLAGS = ("--enable-metrics", "--decode-log-interval", "1", "--oea-dump-steps", "16", "--oea-check-ranks", "1", *TP)


def check_serves(base, count=8, tokens=20):
    """Concurrent completions, a streamed completion and a chat completion, all complete."""
    assert all(r["usage"]["completion_tokens"] == tokens for r in concurrent(base, count, tokens))
    payload = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
    stream = post(base + "/v1/completions", payload)
    assert stream.count("data: ") >= 3 and stream.rstrip().endswith("data: [DONE]")
    chat = post(base + "/v1/chat/completions", {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]})
    assert '"completion_tokens"' in chat


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, models):
    """(URL, log path, router-dump folder, fault switch path): the trained Qwen3-MoE at TP=2, OEA on
    at k0=1, every process loading FAULT, which stays inert until the switch file exists."""
    dump = str(tmp_path_factory.mktemp("dump"))
    fault = tmp_path_factory.mktemp("fault")
    (fault / "sitecustomize.py").write_text(FAULT)
    switch = str(fault / "diverge")
    env = {"PYTHONPATH": os.pathsep.join([str(fault), os.environ.get("PYTHONPATH", "")]), FAULT_SWITCH: switch}
    flags = (*FP32, "--oea-k0", "1", "--oea-min-batch", "1", "--oea-dump-router-logits", dump, *LOAD_FLAGS)
    with serve(tmp_path_factory, models["qwen3_moe_trained"], *flags, extra_env=env) as (base, log):
        yield base, log, dump, switch


def test_ranks_route_alike_under_load_and_off_is_identical(reference, tp_server):
    base, log, dump, _ = tp_server
    check_serves(base)
    check_ranks_agree(base, log, dump, layers=4)
    # The identity checks below can fail: k0=1 at min-batch 1 (pure pruning, one request at a
    # time) changes greedy outputs.
    assert greedy_ids(base, reference["prompts"]) != reference["ids"]
    check_live_changes(base, log)
    for k0 in (TOP_K, 0):  # a no-op, then off: SGLang's own routing on both ranks
        set_live(base, oea_k0=k0, oea_min_batch=1, oea_max_batch=0)
        assert greedy_ids(base, reference["prompts"]) == reference["ids"], k0
    assert rank_lines(log, r"sglang-oea rank \d: OEA on, k0=1 .* check_ranks=1") == {"0": 1, "1": 1}
    assert "routed different experts" not in open(log).read()


LIVE_CHANGES = ({"oea_k0": 3}, {"oea_k0": 0}, {"oea_k0": 2, "oea_min_batch": 2, "oea_max_batch": 8})


def check_live_changes(base, log):
    """POST /set_internal_state reaches both ranks in the same scheduler iteration (SGLang
    broadcasts control requests over the TP group): each change lands at the same routed step on
    both, and the rank check keeps passing under load between the changes."""
    checks = oea_value(scrape(base), "sglang:oea_rank_checks_total", tp_rank="1")
    logged = len(changes_logged(log))
    for settings in LIVE_CHANGES:
        set_live(base, **settings)
        assert all(r["usage"]["completion_tokens"] == 12 for r in concurrent(base, 4, 12))
    by_rank = {}
    for rank, _, new, step in changes_logged(log)[logged:]:
        by_rank.setdefault(rank, []).append((new, step))
    assert [new for new, _ in by_rank["0"]] == ["k0=3 min_batch=1 max_batch=0", "k0=0 min_batch=1 max_batch=0",
                                                "k0=2 min_batch=2 max_batch=8"]
    assert by_rank["0"] == by_rank["1"], "both ranks switch at the same routed step"
    metrics = scrape(base)
    assert oea_value(metrics, "sglang:oea_rank_checks_total", tp_rank="1") > checks + 20
    assert [oea_value(metrics, "sglang:oea_k0", tp_rank=rank) for rank in RANKS] == [2, 2]
    assert "routed different experts" not in open(log).read()
    # A value past the int32 control block is refused on every rank, and the server keeps serving.
    assert json.loads(post(base + "/set_internal_state", {"server_args": {"oea_k0": 2 ** 31}})) == [False]
    assert all(r["usage"]["completion_tokens"] == 12 for r in concurrent(base, 4, 12))
    assert rank_lines(log, r'sglang-oea: refused \{"oea_k0": 2147483648\}: oea_k0 must be an integer from 0 '
                           r"to 64") == {"0": 1, "1": 1}
    assert [oea_value(scrape(base), "sglang:oea_k0", tp_rank=rank) for rank in RANKS] == [2, 2]


def test_a_rank_divergence_stops_the_server(tp_server):
    """Last on the shared server (it goes down). The check's every-N-steps schedule is
    test_rank_check.py's; here --oea-check-ranks 1: the first decode step after the switch fails."""
    base, log, _, switch = tp_server
    set_live(base, oea_k0=3, oea_min_batch=2)
    assert "routed different experts" not in open(log).read()
    open(switch, "w").close()
    try:
        concurrent(base, 4, 64)
    except Exception:
        pass  # the server goes down under the requests
    deadline = time.time() + 120
    while time.time() < deadline and server_up(base):
        time.sleep(2)
    assert not server_up(base)
    text = open(log).read()
    pattern = r"ranks routed different experts \(decode step \d+; layer 0: rank 0=0x[0-9a-f]{16}, rank 1=0x[0-9a-f]{16}\)"
    assert rank_lines(text.splitlines(), pattern) == {"0": 1, "1": 1}
    assert "restart without --oea-k0" in text


def server_up(base):
    try:
        urllib.request.urlopen(base + "/health", timeout=5)
        return True
    except Exception:
        return False
