"""OEA past one server's tensor-parallel group: data-parallel replicas (`--dp-size 2`) and tensor
parallel across two nodes (`--nnodes 2`, both "nodes" on this machine), each on the real SGLang
server on the CPU engine, with the trained Qwen3-MoE checkpoint in float32.

Unit tests first (the CPU harness's thread binding, the metric labels, the router-dump folders),
then two server tests, one server (or node pair) each, which every check of its mode shares:
- `--dp-size 2`: concurrent requests reach both replicas and OEA applies on both (their own
  dp_rank series); a live change is answered and applied by both, a refused one by neither;
  armed-off and k0 = top-k give transformers' greedy ids (which plain SGLang reproduces,
  test_server_e2e.py), and k0=1 changes them, so that check can fail.
- `--tp 2 --nnodes 2`: requests are served by node 0's HTTP server; both ranks route, the rank
  check passes at every step, each live change lands on both ranks at the same routed step (each
  node logs its own rank), and OEA off and k0 = top-k give transformers' greedy ids, as on one
  node (test_tp.py).
Prefill/decode disaggregation is test_disaggregation.py's (a decode server with SGLang's fake
transfer backend; the real backends need RDMA).
"""

import json
import os
import re
import sys
import urllib.request
from contextlib import ExitStack, contextmanager

import pytest

from serving.servers import Server, child_env, free_port, http_get, wait_ready, wait_until
from sglang_oea import metrics
from sglang_oea.cpu import serve as cpu_serve
from sglang_oea.config import OEAConfig
from sglang_oea.runtime import OEARuntime
from test_live_settings import changes_logged
from test_server_e2e import (FP32, TOP_K, TRAINED, concurrent, greedy_ids, heldout_prompts, oea_value, post, scrape,
                             serve, transformers_greedy)

MODEL = TRAINED["qwen3_moe_trained"]
APPLIED, CHECKS = "sglang:oea_decode_steps_applied_total", "sglang:oea_rank_checks_total"
# Every request routed once k0 is set; the settings of every pass logged and exported.
OEA_FLAGS = (*FP32, "--oea-k0", "0", "--oea-min-batch", "1", "--enable-metrics", "--decode-log-interval", "1")
TOKENS = 12  # greedy tokens per held-out prompt: enough for k0=1 to move some


# ----------------------------------------------------------------------------- units


@pytest.mark.parametrize("argv,binding", [
    (["--tp", "2"], "0|1"),
    (["--dp-size", "2"], "0|1"),  # one rank per replica, by its device index: replica 0, then 1
    (["--tp", "2", "--dp-size", "2"], "0|1|0|1"),  # more ranks than this machine's 2 cores share them
    (["--tp", "2", "--nnodes", "2", "--node-rank", "1"], "0-1"),  # one rank on this node, all its cores
    (["--tp", "1"], None),
])
def test_cpu_serve_binds_every_rank_of_this_node(monkeypatch, argv, binding):
    """SGLang indexes SGLANG_CPU_OMP_THREADS_BIND by a rank's device index on its node (DP
    replicas take consecutive blocks of TP ranks), and wants it whenever there is more than one
    rank in all, even one per node."""
    seen = {}
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", raising=False)
    monkeypatch.setattr(cpu_serve.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_serve.os, "execve", lambda path, cmd, env: seen.update(env))
    cpu_serve.main(["--model-path", "m", *argv])
    assert seen.get("SGLANG_CPU_OMP_THREADS_BIND") == binding
    assert seen.get("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK") == (None if binding is None else "0")


def test_replicas_series_carry_dp_rank_as_sglangs_own_do():
    """SGLang labels a scheduler's series with dp_rank only where a DP controller runs."""
    assert metrics.series_labels("m", 1) == {"model_name": "m", "tp_rank": "1"}
    assert metrics.series_labels("m", 0, dp_rank=1) == {"model_name": "m", "tp_rank": "0", "dp_rank": "1"}


def test_each_replica_dumps_router_logits_into_its_own_folder(tmp_path):
    """Both replicas number their TP ranks and steps from 0: one folder would mix their files."""
    cfg = OEAConfig(k0=2, dump_router_logits=str(tmp_path))
    assert OEARuntime(cfg).dump.directory == str(tmp_path)
    assert OEARuntime(cfg, dp_rank=1).dump.directory == os.path.join(str(tmp_path), "dp1")
    assert sorted(os.listdir(tmp_path)) == ["dp1"]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def reference():
    """Held-out prompts and transformers' float32 greedy ids for them (plain SGLang's, on this
    checkpoint: test_server_e2e.py)."""
    prompts = heldout_prompts(MODEL)
    return {"prompts": prompts, "ids": transformers_greedy(MODEL, prompts, TOKENS)}


def set_live(base, settings, replies):
    """POST /set_internal_state; the reply, one bool per replica, must be `replies`."""
    assert json.loads(post(base + "/set_internal_state", {"server_args": settings})) == replies, settings


def oea_states(base):
    """Every replica's /server_info OEA state, by its dp_rank (internal_states come in the order the
    replicas answer), without dp_rank itself and the kernel part."""
    info = json.loads(urllib.request.urlopen(base + "/server_info", timeout=60).read())
    states = sorted((state["oea"] for state in info["internal_states"]), key=lambda oea: oea["dp_rank"])
    assert [oea["dp_rank"] for oea in states] == list(range(len(states))), "each replica says which it is"
    return [{key: value for key, value in oea.items() if key not in ("kernel", "dp_rank")} for oea in states]


def prefixed(log, tag, pattern):
    """{N: number of log lines matching pattern} for the lines SGLang prefixed with '<tag>N'."""
    counts = {}
    for line in open(log, errors="replace"):
        found = re.search(rf"\b{tag}(\d+)\]", line)
        if found and re.search(pattern, line):
            counts[found.group(1)] = counts.get(found.group(1), 0) + 1
    return counts


# ----------------------------------------------------------------------------- --dp-size 2


@pytest.mark.server
def test_data_parallel_replicas(tmp_path_factory, reference):
    with serve(tmp_path_factory, MODEL, *OEA_FLAGS, "--dp-size", "2") as (base, log):
        armed = {"k0": 0, "min_batch": 1, "max_batch": 0, "envelope": {"min_batch": 1, "max_batch": 0}, "verify": True,
                 "model": {"num_experts": 128, "top_k": TOP_K}}
        assert oea_states(base) == [armed, armed], "one OEA state per replica"
        assert greedy_ids(base, reference["prompts"], TOKENS) == reference["ids"], "armed and off: plain SGLang"
        set_live(base, {"oea_k0": TOP_K}, [True, True])
        assert greedy_ids(base, reference["prompts"], TOKENS) == reference["ids"], "k0 = top-k: a no-op"

        set_live(base, {"oea_k0": 1}, [True, True])
        assert greedy_ids(base, reference["prompts"], TOKENS) != reference["ids"], "k0=1 prunes: the checks can fail"
        assert all(r["usage"]["completion_tokens"] == 8 for r in concurrent(base, 8, 8))
        scraped = scrape(base)
        assert all(oea_value(scraped, APPLIED, dp_rank=dp, k0="1") >= 8 for dp in "01"), "both replicas route"
        assert [oea_value(scraped, "sglang:oea_k0", dp_rank=dp) for dp in "01"] == [1, 1]
        assert prefixed(log, "DP", r"sglang-oea rank 0: settings k0=8 min_batch=1 max_batch=0 -> k0=1 min_batch=1 "
                                   r"max_batch=0 from routed step \d+") == {"0": 1, "1": 1}

        # Refused by every replica, alone or across keys; neither replica changes.
        for bad in ({"oea_k0": 2 ** 31}, {"oea_min_batch": 8, "oea_max_batch": 4}):
            set_live(base, bad, [False, False])
        assert oea_states(base) == [{**armed, "k0": 1}] * 2
        assert prefixed(log, "DP", r'sglang-oea: refused \{"oea_k0": 2147483648\}') == {"0": 1, "1": 1}
        assert prefixed(log, "DP", r'sglang-oea: refused \{"oea_min_batch": 8, "oea_max_batch": 4\}') == {"0": 1, "1": 1}
        assert [new for _, _, new, _ in changes_logged(log)] == ["k0=8 min_batch=1 max_batch=0",
                                                                "k0=8 min_batch=1 max_batch=0",
                                                                "k0=1 min_batch=1 max_batch=0",
                                                                "k0=1 min_batch=1 max_batch=0"]
        assert all(r["usage"]["completion_tokens"] == 4 for r in concurrent(base, 2, 4)), "still serving"


# ----------------------------------------------------------------------------- --nnodes 2


@contextmanager
def two_nodes(tmp_path_factory, *flags, attempts=3):
    """`cpu_serve --tp 2 --nnodes 2` as two launchers on this machine, node 0 and node 1, each
    holding one rank: (node 0's URL, node 1's URL, node 0's log, node 1's log). Node 1 serves only
    /health and /metrics (SGLang's health server of a non-zero node). Every port is picked free;
    a start that fails because another process took one is retried on new ports. Node 0 is
    stopped first: its shutdown stops node 1's scheduler, and node 1's launcher then exits."""
    for attempt in range(attempts):
        ports = {"dist": free_port(), 0: free_port(), 1: free_port()}
        folder = tmp_path_factory.mktemp("nodes")
        logs = [str(folder / f"node{rank}.log") for rank in (0, 1)]
        urls = [f"http://127.0.0.1:{ports[rank]}" for rank in (0, 1)]
        with ExitStack() as stack:
            nodes = {}
            for rank in (1, 0):  # stopped in the reverse order: node 0 first
                nodes[rank] = Server(node_command(rank, ports, flags), logs[rank], node_env())
                stack.callback(nodes[rank].stop)
            try:
                wait_ready(urls[0], 900, nodes[0].proc, logs[0])
                wait_until(lambda: http_get(urls[1] + "/health") is not None, 120)
                assert http_get(urls[1] + "/health") is not None, "node 1's health server does not answer"
            except Exception:
                if attempt + 1 < attempts and any(port_clash(log) for log in logs):
                    continue
                raise
            yield urls[0], urls[1], logs[0], logs[1]
            return


def node_command(rank, ports, flags):
    return [sys.executable, "-m", "sglang_oea.cpu_serve", "--model-path", MODEL, "--host", "127.0.0.1",
            "--port", str(ports[rank]), "--tp", "2", "--nnodes", "2", "--node-rank", str(rank),
            "--dist-init-addr", f"127.0.0.1:{ports['dist']}", "--random-seed", "0", *flags]


def node_env():
    env = child_env()
    env.pop("_SGLANG_OEA_CONFIG", None)
    return env


def port_clash(log):
    """Whether a node's log says one of its ports was taken (SGLang's, ZMQ's or uvicorn's words)."""
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    clashes = ("Address already in use", "EADDRINUSE", "error while attempting to bind on address")
    return any(words in text for words in clashes)


def changes_by_rank(*logs):
    """{rank: [(new settings, routed step)]} of the settings-change lines in the logs."""
    out = {}
    for log in logs:
        for rank, _, new, step in changes_logged(log):
            out.setdefault(rank, []).append((new, step))
    return out


NODE_CHANGES = (
    {"oea_k0": 3},
    {"oea_k0": 2, "oea_min_batch": 2, "oea_max_batch": 8},
    {"oea_k0": 1, "oea_min_batch": 1, "oea_max_batch": 0},
)


@pytest.mark.server
def test_tensor_parallel_across_two_nodes(tmp_path_factory, reference):
    flags = (*OEA_FLAGS, "--oea-check-ranks", "1")
    with two_nodes(tmp_path_factory, *flags) as (base, node1, log0, log1):
        assert greedy_ids(base, reference["prompts"], TOKENS) == reference["ids"], "armed and off: plain SGLang"
        set_live(base, {"oea_k0": TOP_K}, [True])
        assert greedy_ids(base, reference["prompts"], TOKENS) == reference["ids"], "k0 = top-k: a no-op"
        for settings in NODE_CHANGES:  # under load between the changes
            set_live(base, settings, [True])
            assert all(r["usage"]["completion_tokens"] == 8 for r in concurrent(base, 4, 8))
        assert greedy_ids(base, reference["prompts"], TOKENS) != reference["ids"], "k0=1 prunes: the checks can fail"

        # Each node's /metrics has its own rank's series (node 1's from its health server).
        zero, one = scrape(base), scrape(node1)
        assert oea_value(zero, APPLIED, tp_rank="1") == 0 and oea_value(one, APPLIED, tp_rank="0") == 0
        for scraped, rank in ((zero, "0"), (one, "1")):
            assert oea_value(scraped, APPLIED, tp_rank=rank, k0="1") >= 8
            assert oea_value(scraped, CHECKS, tp_rank=rank) >= 20
            assert oea_value(scraped, "sglang:oea_k0", tp_rank=rank) == 1

    by_rank = changes_by_rank(log0, log1)
    assert [new for new, _ in by_rank["0"]] == ["k0=8 min_batch=1 max_batch=0", "k0=3 min_batch=1 max_batch=0",
                                               "k0=2 min_batch=2 max_batch=8", "k0=1 min_batch=1 max_batch=0"]
    assert by_rank["0"] == by_rank["1"], "both ranks switch at the same routed step"
    assert prefixed(log0, "TP", r"sglang-oea rank 0: OEA armed") == {"0": 1}
    assert prefixed(log1, "TP", r"sglang-oea rank 1: OEA armed") == {"1": 1}
    assert not any("routed different experts" in open(log).read() for log in (log0, log1))
