"""benchmark/oea/trial/: what the trial plans and decides, without a server.

SGLang's limits and the gate per replica or, under DP attention, on the gathered batch
(preflight.py), the quality concurrencies (quality.py),
the one budget and its cuts (budget.py), the throughput loop repeating blocks until resolved
(throughput.py, with a stand-in sweep), the accept-length probe sized for its bound (quality.py,
with an in-memory server), the recommendation's cap, flags and "keep OEA off" advice, and the
report's accept-length, budget and recommendation sections (verdict.py); the live-settings client's
all-or-none check over data-parallel ranks (serving/live_settings.py).
"""

import argparse
import json
import os
import random

import pytest

from common import report
from serving import live_settings
from trial import budget as tb, preflight as tp, quality as tq, throughput as tt, verdict as tr

TRAINED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(tp.__file__))), "models", "qwen3_moe_stdlib")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# ----------------------------------------------------------------------------- SGLang's limits, the gate per replica


def eagle_info(tmp_path, dp_size=1, max_running=48, launch="sglang serve --model-path m --speculative-algorithm EAGLE",
               max_bs=32, min_batch=2, max_batch=256):
    """A /server_info shaped like SGLang 0.5.23's under EAGLE (4 draft tokens), with OEA armed and off."""
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 8}))
    oea = {"k0": 0, "min_batch": min_batch, "max_batch": max_batch, "verify": True,
           "envelope": {"min_batch": min_batch, "max_batch": max_batch}}
    state = {"oea": oea, "effective_max_running_requests_per_dp": max_running}
    return {"internal_states": [dict(state) for _ in range(dp_size)], "enable_metrics": True, "tp_size": 8,
            "dp_size": dp_size, "speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 4,
            "max_running_requests": max_running, "launch_command": launch, "model_path": str(tmp_path),
            "cuda_graph_config": {"decode": {"backend": "full", "max_bs": max_bs}, "prefill": {}}}


def test_sglang_limits_mark_what_the_server_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setattr(tp, "read_server_info", lambda url: eagle_info(tmp_path))
    pre = tp.preflight("http://x", None, [4], [16, 32, 64])
    assert (pre.limits.max_running, pre.limits.default_cap, pre.limits.graph_max_bs) == (48, True, 32)
    c32, c64 = pre.gates[1], pre.gates[2]
    assert c32.open and not c32.above_limit and c32.rows == 128
    # C=64: the server runs 48 of them; the gate sees 48 x 4 rows, and 48 > the graphs' 32
    assert c64.above_limit and c64.eager and (c64.requests, c64.rows) == (48, 192)
    assert "at most 48 requests at once: the rest wait" in c64.why and "cuda_graph_max_bs 32" in c64.why
    assert "SGLang's default under speculative decoding: --max-running-requests is not set" in " ".join(pre.lines)
    assert any(w.startswith("C=64: above the 48 requests a replica runs at once") for w in pre.warnings)
    given = eagle_info(tmp_path, launch="sglang serve --speculative-algorithm EAGLE --max-running-requests 48")
    assert not tp.read_limits(given, "EAGLE").default_cap  # set by the operator: not SGLang's default
    no_graphs = {**given, "cuda_graph_config": {"decode": {"backend": "disabled", "max_bs": 32}}}
    assert tp.read_limits(no_graphs, "EAGLE").graph_max_bs is None


def test_the_gate_is_computed_per_replica(tmp_path, monkeypatch):
    """Under --dp-size 4 each replica forms its own batches from about C / 4 of the requests."""
    monkeypatch.setattr(tp, "read_server_info", lambda url: eagle_info(tmp_path, dp_size=4, min_batch=4,
                                                                       max_batch=64))
    pre = tp.preflight("http://x", None, [4], [8, 16, 64, 96])
    by = {g.concurrency: g for g in pre.gates}
    assert not by[8].open
    assert by[8].why.startswith("2 requests per replica (4 replicas) x 4 rows = 8 rows < min_batch 4")
    assert by[16].open and (by[16].requests, by[16].rows) == (4, 16)
    assert by[64].open and by[64].rows == 64  # 16 per replica x 4 rows: inside the cap, though 64 x 4 is not
    assert not by[96].open and "> max_batch 64" in by[96].why
    assert pre.smallest_open_concurrency() == 16  # 4 requests on each of 4 replicas
    uneven = tp.gate_at(18, {"oea_min_batch": 4, "oea_max_batch": 64}, 4, None, replicas=4)
    assert uneven.why.startswith("4-5 requests per replica") and uneven.rows == 20


def test_quality_runs_where_the_gate_opens_and_at_the_largest_open_concurrency(tmp_path, monkeypatch):
    monkeypatch.setattr(tp, "read_server_info", lambda url: eagle_info(tmp_path, min_batch=2, max_batch=128))
    pre = tp.preflight("http://x", None, [4], [16, 32, 64])  # 64 x 4 rows > 128: closed
    at = tq.quality_concurrencies(pre, None)
    assert [(q["concurrency"], q["rows"]) for q in at] == [(2, 8), (32, 128)]
    assert at[0]["why"].startswith("the smallest concurrency at which the gate opens (min_batch 2 requests, 4 rows "
                                   "each)")
    assert at[1]["why"] == "the largest swept concurrency with an open gate"
    assert [q["concurrency"] for q in tq.quality_concurrencies(pre, [8, 8, 16])] == [8, 16]
    monkeypatch.setattr(tp, "read_server_info", lambda url: eagle_info(tmp_path, dp_size=2, min_batch=2))
    pre = tp.preflight("http://x", None, [4], [4])
    assert [q["concurrency"] for q in tq.quality_concurrencies(pre, None)] == [4]  # the same C: once


def dp_attention_info(tmp_path, min_batch=4, max_batch=256, max_bs=16):
    """/server_info shaped like a real SGLang 0.5.23 server's with --tp 2 --attn-dp-size 2 under EAGLE
    (4 draft tokens, --max-running-requests not set: 48 in all, 24 per group): dp_size 1, one
    internal state per attention-DP group's scheduler, each OEA state with its group as dp_rank."""
    info = eagle_info(tmp_path, dp_size=2, max_running=24, max_bs=max_bs, min_batch=min_batch, max_batch=max_batch)
    for rank, state in enumerate(info["internal_states"]):
        state["oea"] = {**state["oea"], "dp_rank": rank}
    return {**info, "dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True, "tp_size": 2,
            "max_running_requests": 48}


def test_under_dp_attention_the_gate_counts_the_gathered_batch(tmp_path, monkeypatch):
    """The attention-DP groups are not replicas for OEA: every group's requests form one batch."""
    monkeypatch.setattr(tp, "read_server_info", lambda url: dp_attention_info(tmp_path))
    pre = tp.preflight("http://x", None, [4], [2, 4, 5, 32, 40, 64])
    assert (pre.limits.replicas, pre.limits.groups, pre.limits.max_running, pre.limits.batch_max) == (1, 2, 24, 48)
    assert pre.limits.default_cap  # SGLang's 48, split 24 + 24
    by = {g.concurrency: g for g in pre.gates}
    assert not by[2].open and by[2].why.startswith("2 requests gathered from 2 attention-DP groups (1 each)")
    # min_batch 4 opens at C=4, though each group holds 2 (as replicas, 2 < 4 would keep it closed)
    assert by[4].open and (by[4].requests, by[4].rows, by[4].group_requests) == (4, 16, 2)
    assert by[4].why == ("4 requests gathered from 2 attention-DP groups (2 each) x 4 rows = 16 rows: >= min_batch 4, "
                         "<= max_batch 256 rows")
    assert by[5].why.startswith("5 requests gathered from 2 attention-DP groups (2-3 each)")
    assert pre.smallest_open_concurrency() == 4
    # the decode graphs' max_bs 16 is per group: 32 gathered (16 each) replay graphs, 40 (20 each) run eagerly
    assert not by[32].eager and by[40].eager and "the busiest group's 20 requests are above cuda_graph_max_bs 16" \
        in by[40].why
    # at most 48 gathered (24 per group): C=64 routes 48 x 4 rows
    assert by[64].above_limit and not by[40].above_limit and (by[64].requests, by[64].rows) == (48, 192)
    assert "at most 48 requests at once (24 per attention-DP group): the rest wait" in by[64].why
    lines = " | ".join(pre.lines)
    assert ("limits: DP attention: 2 attention-DP groups; OEA's gate counts their requests together (one gathered "
            "batch), up to 48 requests (24 per group, SGLang's default under speculative decoding: "
            "--max-running-requests is not set); decode CUDA graphs up to 16 requests per group") in lines
    assert "OEA armed on 2 scheduler(s) (one per attention-DP group)" in lines and "attn_dp_size 2" in lines
    assert any(w.startswith("C=64: above the 48 requests the 2 attention-DP groups run at once together (24 each)")
               for w in pre.warnings)
    # quality where the gate first opens, counted over both groups; the cap in gathered token rows
    at = tq.quality_concurrencies(pre, None)
    assert (at[0]["concurrency"], at[0]["rows"]) == (4, 16)
    assert "min_batch 4 requests counted over 2 attention-DP groups together, 4 rows each" in at[0]["why"]
    spreads = {(4, 1.10, 1.12, 1.14), (32, 1.04, 1.06, 1.08), (40, 0.90, 0.92, 0.94)}
    summary = report.Summary([], [], {}, {(c, report.arm_name(4)): report.Spread(m, lo, hi, 3)
                                          for c, lo, m, hi in spreads})
    cells = [c for c in tr.build_cells(pre, [4], summary, {}, None, None) if c["concurrency"] in (4, 32, 40)]
    rec = tr.recommend([4], cells, None, False, pre.original, pre.rows_per_request)
    assert rec["cap"]["max_batch"] == 128  # 32 requests gathered x 4 rows, not one group's 16 x 4
    assert rec["flags"] == "--oea-k0 4 --oea-min-batch 4 --oea-max-batch 128"


def test_under_dp_attention_the_cap_counts_every_group(tmp_path, monkeypatch):
    monkeypatch.setattr(tp, "read_server_info", lambda url: dp_attention_info(tmp_path, min_batch=2, max_batch=64))
    pre = tp.preflight("http://x", None, [4], [16, 20])
    assert pre.gates[0].open and pre.gates[0].rows == 64
    assert not pre.gates[1].open and "= 80 rows > max_batch 64" in pre.gates[1].why  # 10 per group: 40 as replicas


def test_how_data_parallel_fields_are_read():
    """SGLang 0.5.23: --attn-dp-size G reports attn_dp_size G, dp_size 1; a server reporting the
    deprecated spelling (dp_size G with enable_dp_attention, no attn_dp_size) has G groups too."""
    assert tp.data_parallel({"dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}) == (1, 2)
    assert tp.data_parallel({"dp_size": 4, "enable_dp_attention": True}) == (1, 4)
    assert tp.data_parallel({"dp_size": 4, "attn_dp_size": 1, "enable_dp_attention": False}) == (4, 1)
    assert tp.data_parallel({}) == (1, 1)
    # without the per-scheduler figure, SGLang's split of the server's limit over the groups
    limits = tp.read_limits({"attn_dp_size": 2, "max_running_requests": 48, "internal_states": [{}, {}]}, "EAGLE")
    assert (limits.max_running, limits.batch_max, limits.default_cap) == (24, 48, True)


# ----------------------------------------------------------------------------- the budget


def work(**kw):
    base = dict(arms=2, output_len=100, throughput=[(16, 64), (32, 128)], max_repeats=10,
                accept=[(16, 32), (32, 64)], quality=[(2, 100, 256, "smallest"), (32, 100, 256, "largest")],
                quality_what="quality_ab, q.jsonl")
    return tb.Work(**{**base, **kw})


def test_the_budget_covers_the_whole_trial_and_says_what_it_cuts():
    clock = Clock()
    budget = tb.Budget(10, work(), clock)
    assert budget.plan_lines()[0].endswith("times follow once the first run has measured the speed")
    budget.speed.add(16, 1600.0, "the start-up warm-up")
    # 1600 tok/s at C=16: the same above it, proportional to C below it
    assert (budget.speed.at(32), budget.speed.at(2)) == (1600.0, 200.0)
    assert budget.throughput_min_s() == pytest.approx(2 * 6400 / 1600 + 2 * 12800 / 1600)  # one block each: 24 s
    assert budget.accept_floor_s() == pytest.approx(12.0)
    assert budget.accept_reserve_s() == pytest.approx(150.0)  # a quarter of the budget, more than its floor
    assert budget.quality_reserve_s() == pytest.approx(2 * 25600 / 200 + 2 * 25600 / 1600)  # 256 + 32 s
    assert budget.throughput_left() == pytest.approx(600 - 150 - 288)
    clock.now += 100
    assert budget.throughput_left() == pytest.approx(500 - 150 - 288)
    assert budget.accept_left() == pytest.approx(500 - 288)
    lines = budget.plan_lines()
    assert "times from 1600 tok/s at C=16 (the start-up warm-up)" in lines[0]
    assert "about 6 block(s) per concurrency fit" in lines[1]
    assert lines[-1] == "to fit: throughput blocks past 6 per concurrency will be cut"

    tight = tb.Budget(4, work(), clock)
    tight.speed.add(16, 1600.0, "the start-up warm-up")
    assert tight.blocks_that_fit() == 0
    assert tight.plan_lines()[-1] == (
        "to fit: quality at C=32; throughput blocks past 1 per concurrency will be cut; the minimum (one block per "
        "concurrency, the accept floor, quality at its first concurrency) needs about 4.9 min, over the budget: it "
        "runs anyway")
    clock.now += 230
    assert tight.quality_fits(2, first=True)  # the first quality concurrency is never cut
    assert not tight.quality_fits(32, first=False) and tight.cut_quality == [32]
    assert tight.cuts == ["quality at C=32 (about 0.5 min, 0.2 min of the budget left)"]
    assert tight.quality_reserve_s() == pytest.approx(256.0)  # the cut one no longer reserved


def test_a_share_of_the_time_left_per_concurrency():
    clock = Clock()
    end = clock.now + 100
    share = tb.share_of(lambda: end - clock(), 2, clock)
    assert share() == pytest.approx(50.0)
    clock.now += 10
    assert share() == pytest.approx(40.0)  # half of the 100 s it started with, less the 10 spent


def test_quality_past_the_first_concurrency_runs_only_when_it_fits(tmp_path, monkeypatch):
    clock = Clock()
    budget = tb.Budget(4, work(accept=[]), clock)
    budget.speed.add(16, 1600.0, "a run")
    ran = []

    def fake_quality_ab(args, url, k0s, conc, out, budget):
        ran.append(conc)
        clock.now += 200
        budget.quality_arm_s.setdefault(conc, 100.0)
        return {"tool": "quality-ab", "concurrency": conc, "per_k0": {}}

    monkeypatch.setattr(tq, "run_quality_ab", fake_quality_ab)
    args = argparse.Namespace(quality="quality-ab", out_dir=str(tmp_path))
    at = [{"concurrency": 2, "why": "smallest", "rows": 2}, {"concurrency": 32, "why": "largest", "rows": 32}]
    runs = tq.run_quality(args, "http://x", [4], at, budget, None)
    # the C=2 arm took 100 s: C=32 (8 x the speed) needs 2 x 100 / 8 = 25 s, and 40 s are left
    assert ran == [2, 32] and [r["why"] for r in runs] == ["smallest", "largest"]
    ran.clear()
    budget = tb.Budget(3, work(accept=[]), clock)
    budget.speed.add(16, 1600.0, "a run")
    runs = tq.run_quality(args, "http://x", [4], at, budget, None)  # 180 s: nothing left after C=2
    assert ran == [2] and [r["concurrency"] for r in runs] == [2] and budget.cut_quality == [32]
    assert tq.run_quality(argparse.Namespace(quality="none"), "http://x", [4], at, budget, None) is None


# ----------------------------------------------------------------------------- the throughput loop


class FakeSweep:
    """one_server.LiveSweep's measure(): a record per run in results.jsonl, throughput from tput(k0, repeat)."""

    def __init__(self, jsonl, tput, runs_dir="runs"):
        self.jsonl, self.tput, self.runs_dir, self.order = jsonl, tput, runs_dir, []

    def start(self):
        os.makedirs(self.runs_dir, exist_ok=True)
        with open(os.path.join(self.runs_dir, "baseline_warmup.jsonl"), "w") as f:
            f.write(json.dumps({"max_concurrency": 8, "output_throughput": 400.0}) + "\n")

    def measure(self, arm, conc, rep, block, progress):
        self.order.append((conc, block, rep, arm.k0 or 0))
        record = {"arm": arm.name, "k0": arm.k0, "concurrency": conc, "repeat": rep, "seed": rep, "num_prompts": 8,
                  "input_len": 32, "output_len": 16, "prompts": "p", "output_throughput": self.tput(arm.k0 or 0, rep)}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        return True


def steady(k0, rep):
    return 110.0 if k0 else 100.0


def noisy(k0, rep):
    return (120.0 if rep % 2 else 95.0) if k0 else 100.0


@pytest.mark.parametrize("tput, time_left, blocks, stopped", [
    (steady, float("inf"), 3, "resolved"),  # +10% every block: resolved at the third
    (noisy, float("inf"), 5, "max_repeats"),  # never resolved: every block up to --max-repeats
    (steady, -1.0, 1, "budget"),  # no time left: the one block every concurrency gets
])
def test_blocks_repeat_until_resolved(tmp_path, tput, time_left, blocks, stopped):
    jsonl = str(tmp_path / "results.jsonl")
    sweep, arms = FakeSweep(jsonl, tput), tt.trial_arms([4])
    after = []
    assert tt.run_concurrency(sweep, arms, 4, 7, lambda: time_left, 5, jsonl, lambda: after.append(1),
                              Clock()) == (
        7 + blocks, blocks, stopped)
    assert len(after) == blocks
    # one run per arm per block, the order reversed every other block (numbered over the sweep)
    assert sweep.order == [(4, b, b - 7, k0) for b in range(7, 7 + blocks) for k0 in ((0, 4) if b % 2 == 0 else (4, 0))]


def test_the_throughput_phase_shares_the_budget_and_feeds_its_speed(tmp_path, monkeypatch):
    clock = Clock()
    budget = tb.Budget(10, work(throughput=[(4, 8), (8, 16)], accept=[], quality=[]), clock)

    def spend(k0, rep):  # each run takes 100 s of the budget's clock
        clock.now += 100
        return noisy(k0, rep)

    monkeypatch.setattr(tt, "LiveSweep", lambda arms, url, sargs, client, server, jsonl: FakeSweep(
        jsonl, spend, str(tmp_path / "runs")))
    monkeypatch.setattr(tt, "BenchClient", lambda sargs, name: argparse.Namespace(close=lambda: None))
    records = tt.run_throughput("http://x", argparse.Namespace(out_dir=str(tmp_path), k0=[4]), [4, 8], budget, 5)
    # 600 s for two concurrencies, blocks of 200 s: C=4 has 300 s, so no second block after the first;
    # C=8 has the 400 s left: two blocks
    assert [(r["concurrency"], r["repeat"]) for r in records if r["arm"] == "baseline"] == [(4, 0), (8, 0), (8, 1)]
    assert budget.cuts == ["throughput at C=4: 1 of up to 5 blocks, not resolved",
                           "throughput at C=8: 2 of up to 5 blocks, not resolved"]
    assert budget.speed.source == "400 tok/s at C=8 (the start-up warm-up)"
    assert budget.announced and budget.plan[0].endswith("times from 400 tok/s at C=8 (the start-up warm-up)")
    assert sorted(budget.speed.samples[8]) == [95.0, 100.0, 100.0, 120.0, 400.0]  # the warm-up, every run once


# ----------------------------------------------------------------------------- the accept-length probe


class SpecServer:
    """each_arm's server in memory: the k0 set live, and each prompt's accept length per arm."""

    def __init__(self, length):
        self.length, self.k0, self.calls = length, 0, []

    def apply(self, url, settings, key=None):
        self.k0 = settings["oea_k0"]
        return {}

    def run_arm(self, name, url, items, opts):
        self.calls.append((name, self.k0, len(items)))
        lengths = [self.length(int(it.prompt.split()[1]), self.k0) for it in items]
        return {"outputs": [{"spec": {"accept_length": a}} for a in lengths], "elapsed_s": 1.0}


def noisy_lengths(n=1024, change=-0.01, spread=0.3):
    """{k0: [accept length per prompt]}: OEA (k0 4) 1% shorter on average, with a wide spread per prompt."""
    rng = random.Random(1)
    off = [2.5 + 0.5 * ((7 * i) % 5) / 4 for i in range(n)]
    return {0: off, 4: [a * (1 + change + rng.choice((-spread, spread))) for a in off]}


@pytest.fixture
def spec_server(monkeypatch):
    def install(lengths):
        server = SpecServer(lambda i, k0: lengths[k0][i])
        monkeypatch.setattr(tq, "apply_settings", server.apply)
        monkeypatch.setattr(tq, "confirm_settings", lambda *a, **k: [])
        monkeypatch.setattr(tq, "fetch_text", lambda *a, **k: None)
        monkeypatch.setattr(tq, "run_arm", server.run_arm)
        return server
    return install


def test_the_accept_probe_runs_until_its_interval_clears_the_bound(spec_server):
    lengths = noisy_lengths()
    server = spec_server(lengths)
    prompts = [f"prompt {i}" for i in range(1024)]
    out = tq.accept_probe("http://x", [4], [16], prompts, 8, None, 60.0, floor=32)
    check = out[16][4]
    n = check["prompts"]
    assert not tq.decided(tq.accept_check(lengths[0][:32], lengths[4][:32]))  # the floor alone does not decide
    assert check["rounds"] >= 2 and check["floor"] == 32 and n > 32
    assert check["sized"] == f"cleared the bound after {n} prompts" and check["non_inferior"]
    # each round: off then k0 4, on the same fresh prompts; the first is the floor
    sizes = [calls[2] for calls in server.calls[::2]]
    assert sizes[0] == 32 and sum(sizes) == n and [c[1] for c in server.calls] == [0, 4] * check["rounds"]
    # paired by prompt, OEA against off
    off, oea = lengths[0][:n], lengths[4][:n]
    assert check["change"] == pytest.approx((sum(oea) - sum(off)) / sum(off))
    assert (check["low"], check["high"]) == pytest.approx((tq.accept_check(off, oea)["low"],
                                                           tq.accept_check(off, oea)["high"]))
    shorter = spec_server(noisy_lengths(change=-0.15, spread=0.05))  # clearly worse: decided early
    worse = tq.accept_probe("http://x", [4], [16], prompts, 8, None, 60.0, floor=32)[16][4]
    assert not worse["non_inferior"] and worse["high"] < -0.05 and worse["rounds"] == 1
    assert len(shorter.calls) == 2


def test_the_accept_probe_says_when_the_budget_or_the_prompts_end_it(spec_server):
    spec_server(noisy_lengths())
    prompts = [f"prompt {i}" for i in range(1024)]
    spent = tq.accept_probe("http://x", [4], [16], prompts, 8, None, 60.0, floor=32, time_left=lambda: 0.0)[16][4]
    assert (spent["prompts"], spent["rounds"]) == (32, 1)
    assert spent["sized"] == "the budget ended at 32 prompts, the interval not clear of the bound"
    few = tq.accept_probe("http://x", [4], [16], prompts[:40], 8, None, 60.0, floor=32)[16][4]
    assert (few["prompts"], few["rounds"]) == (40, 2)
    assert few["sized"] == "the prompt file ran out at 40 prompts, the interval not clear of the bound"
    large = tq.accept_probe("http://x", [4], [64], prompts, 8, None, 60.0, floor=32, time_left=lambda: 0.0)[64][4]
    assert large["floor"] == 128  # at least two waves of C


def test_next_round_is_sized_from_the_interval():
    wide = {"low": -0.12, "high": 0.08, "change": -0.02, "bound": -0.05}  # half-width 0.10, 0.03 from the bound
    assert tq.next_round({4: wide}, 32, 16, 1000, 1000) == 96  # 32 x 1.2 x (0.10 / 0.03)^2 = 427: 3 x 32 at most
    near = {"low": -0.055, "high": 0.005, "change": -0.025, "bound": -0.05}  # half 0.03, gap 0.025: 55 in all
    assert tq.next_round({4: near}, 32, 16, 1000, 1000) == 24
    assert tq.next_round({4: near}, 32, 16, 1000, 10) == 0  # not even C affordable
    assert tq.next_round({4: wide}, 32, 16, 1000, 50) == 50
    assert tq.next_round({4: wide}, 32, 16, 8, 1000) == 8  # what is left of the file


# ----------------------------------------------------------------------------- the recommendation


def cell(k0, conc, lo, med, hi, rows=None, accept=None):
    ratio = report.Spread(med, lo, hi, 3)
    return {"k0": k0, "concurrency": conc, "gate_open": True, "ratio": med, "ratio_low": lo, "ratio_high": hi,
            "resolved": report.resolved(ratio), "verdict": tr.cell_verdict(True, ratio), "accept_length": accept,
            "rows": rows if rows is not None else 4 * conc}


GOOD = {"non_inferior": True}
SERVER = {"oea_k0": 0, "oea_min_batch": 2, "oea_max_batch": 256}


def test_a_k0_slower_only_at_high_concurrency_gets_a_cap():
    cells = [cell(4, 16, 1.10, 1.12, 1.14, accept=GOOD), cell(4, 32, 1.04, 1.06, 1.08, accept=GOOD),
             cell(4, 64, 0.90, 0.92, 0.94, accept={"non_inferior": False})]
    quality = [{"concurrency": 2, "rows": 8, "per_k0": {4: {"within": True}}},
               {"concurrency": 64, "rows": 256, "per_k0": {4: {"within": False}}}]
    rec = tr.recommend([4], cells, quality, True, SERVER, 4)
    assert rec["k0"] == 4 and rec["cap"] == {"max_batch": 128, "faster_up_to": 32, "slower": [64]}
    assert rec["flags"] == "--oea-k0 4 --oea-min-batch 2 --oea-max-batch 128"
    assert rec["settings"] == {"oea_k0": 4, "oea_max_batch": 128} and rec["off"] is None
    assert ("slower at C=64, above every concurrency where it is faster: the cap --oea-max-batch 128 (128 token "
            "rows: 32 requests x 4 draft tokens) keeps it to C <= 32") in rec["reason"]
    # slower at a concurrency below one where it is faster: no cap can keep it to where it helps
    mixed = [cell(5, 16, 0.90, 0.92, 0.94, accept=GOOD), cell(5, 32, 1.04, 1.06, 1.08, accept=GOOD)]
    rec = tr.recommend([5], mixed, [{"concurrency": 2, "rows": 8, "per_k0": {5: {"within": True}}}], True, SERVER, 4)
    assert rec["k0"] == 0 and rec["problems"][5] == ["slower at C=16"] and tr.cap_for(5, mixed) is None
    # faster everywhere: the server's cap stays
    rec = tr.recommend([4], cells[:2], quality[:1], True, SERVER, 4)
    assert rec["flags"] == "--oea-k0 4 --oea-min-batch 2 --oea-max-batch 256" and rec["settings"] == {"oea_k0": 4}


def test_quality_counts_at_every_concurrency_it_ran():
    cells = [cell(4, 16, 1.10, 1.12, 1.14), cell(4, 32, 1.04, 1.06, 1.08)]
    quality = [{"concurrency": 2, "per_k0": {4: {"within": True}}},
               {"concurrency": 32, "per_k0": {4: {"within": False}}}]
    rec = tr.recommend([4], cells, quality, False, SERVER)
    assert rec["k0"] == 0 and rec["problems"][4] == ["quality not within its bound at C=32"]
    assert tr.recommend([4], cells, [], False, SERVER)["problems"][4] == ["quality not measured"]


def test_keep_oea_off_says_how_to_take_it_off_and_what_arming_costs():
    rec = tr.recommend([4], [cell(4, 16, 0.9, 1.1, 1.3)], None, False, SERVER)
    assert rec["k0"] == 0 and rec["flags"] is None
    assert rec["off"].startswith("The server is left armed and off (k0 0). To take OEA off the routing path, "
                                 "restart the server without --oea-k0")
    assert "What arming costs meanwhile: not measured on a GPU yet" in rec["off"]
    assert "a 2-core CPU machine, 2026-12-03" in rec["off"]
    assert "a CPU figure, it says nothing about a GPU" in rec["off"]
    found_on = tr.recommend([4], [cell(4, 16, 0.9, 1.1, 1.3)], None, False, {**SERVER, "oea_k0": 5})
    assert "put back the k0 5 it found: set k0 0 live now" in found_on["off"]


# ----------------------------------------------------------------------------- the report


def speculative_result(rec):
    arm = {"concurrency": 4, "k0": 4, "repeats": 3, "output_throughput": 90.0, "median_tpot_ms": 40.0,
           "t_before": 20.0, "t_after": 12.0, "applied_share": 0.9, "kept_router_mass": 0.8, "accept_length": 2.6}
    probe = {4: {4: {"n": 96, "off": 2.79, "oea": 2.60, "change": -0.067, "low": -0.133, "high": -0.001,
                     "bound": -0.05, "non_inferior": False, "prompts": 96, "rounds": 2, "floor": 32,
                     "sized": "the budget ended at 96 prompts, the interval not clear of the bound"}}}
    budget = {"minutes": 30, "plan": ["budget: 30 min for the whole trial", "to fit: nothing is cut"],
              "cuts": ["quality at C=4 (about 9.0 min, 2.0 min of the budget left)"],
              "phases": {"throughput": 20.0, "accept length": 6.5, "quality": 1.0}, "used_minutes": 27.6}
    return {"model": "m", "label": None, "url": "http://x", "started": "s", "finished": "f", "status": "done",
            "prompts": "p", "preflight": {"speculative": "EAGLE", "lines": [], "warnings": [], "gates": []},
            "arms": [{**arm, "arm": "baseline", "k0": 0, "accept_length": 2.46}, {**arm, "arm": "oea-k0=4"}],
            "quality": None, "cells": [], "accept_length_probe": probe, "budget": budget, "recommendation": rec,
            "restored": {"oea_k0": 0}, "restore_note": "put back"}


def test_the_report_reconciles_accept_length_and_shows_budget_and_flags():
    on = tr.recommend([4], [cell(4, 16, 1.10, 1.12, 1.14)], None, False, SERVER)
    markdown = tr.render_markdown(speculative_result(on))
    assert "| accept len (context) |" in markdown
    assert tr.ACCEPT_CONTEXT_NOTE + "." in markdown and "The paired probe below decides" in markdown
    assert ("- C=4, k0=4: off 2.79, OEA 2.60 over 96 prompts; -6.7% [-13.3%, -0.1%]: NOT shown non-inferior "
            "(bound -5%); 2 round(s) from a floor of 32: the budget ended at 96 prompts, the interval not clear of "
            "the bound") in markdown
    assert "Cut: quality at C=4 (about 9.0 min, 2.0 min of the budget left)." in markdown
    assert "Time: throughput 20.0 min, accept length 6.5 min, quality 1.0 min; 27.6 of 30 min used." in markdown
    assert "**Recommendation: leave k0 = 4 on.**" in markdown
    assert "Live settings are lost at a restart: to keep them, launch with\n\n    --oea-k0 4 --oea-min-batch 2 " \
           "--oea-max-batch 256\n" in markdown
    off = tr.render_markdown(speculative_result(tr.recommend([4], [cell(4, 16, 0.9, 1.1, 1.3)], None, False, SERVER)))
    assert "**Recommendation: keep OEA off.**" in off and "restart the server without --oea-k0" in off


# ----------------------------------------------------------------------------- the client, and the prompts


def test_a_refusal_by_any_data_parallel_rank_is_a_refusal(monkeypatch):
    """SGLang answers one boolean per DP rank: the change is taken only when every rank took it."""
    replies = iter([[True, False], [False, True], [True, True]])
    monkeypatch.setattr(live_settings, "http_json", lambda *a, **k: next(replies))
    for _ in range(2):
        with pytest.raises(live_settings.LiveSettingsError, match="refused"):
            live_settings.post_settings("http://x", {"oea_k0": 4})
    assert live_settings.post_settings("http://x", {"oea_k0": 4}) == [True, True]


def test_default_prompts_hold_more_for_the_accept_probe(tmp_path):
    from trial import prompts as tpr

    path = str(tmp_path / "p.json")
    tpr.write_default_prompts(TRAINED, path, 4, 32, wanted=12)
    first = tpr.prompt_texts(path)
    assert len(first) == 12 and len(tpr.prompt_texts(path, 3)) == 3
    # more than the held-out text's 44 documents: their later windows, distinct (its source repeats
    # lines), from the held-out text; the first ones (what the throughput runs send) unchanged
    tpr.write_default_prompts(TRAINED, path, 4, 32, wanted=100)
    many = tpr.prompt_texts(path)
    heldout = open(os.path.join(TRAINED, "heldout.txt")).read()
    assert len(set(many)) == 100 and many[:12] == first and all(text in heldout for text in many)
