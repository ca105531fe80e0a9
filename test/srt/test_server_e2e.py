"""End to end on the real SGLang server (CPU engine, tiny dummy-weight models of both archs).

One server at a time (this machine has 2 cores); each module-scoped fixture owns one server.
"""

import json
import os
import re
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.server

from ab_serving import PortTakenError, Server, child_env, free_port, wait_ready
from sglang_oea.tiny_model import main as write_tiny_model

NUM_EXPERTS, TOP_K = 64, 8
PROMPTS = ["The experts of a batch", "Memory bound decode means", "Tokens borrow experts", "0123 4567 89"]


def make_model(directory, arch, *extra):
    write_tiny_model(["--arch", arch, "--out", directory, "--num-experts", str(NUM_EXPERTS), "--top-k", str(TOP_K),
                      "--hidden-size", "128", "--moe-intermediate-size", "64", "--num-layers", "2", "--num-heads", "4",
                      *extra])
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Both router families with dummy weights, and "qwen3_moe_weighted": a checkpoint with real
    random weights, for the tests whose outputs must be able to differ (see tiny_model)."""
    root = tmp_path_factory.mktemp("models")
    made = {arch: make_model(str(root / arch), arch) for arch in ("qwen3_moe", "glm4_moe")}
    made["qwen3_moe_weighted"] = make_model(str(root / "weighted"), "qwen3_moe", "--random-weights")
    return made


@contextmanager
def serve(tmp_path_factory, model, *flags, plugins=True, extra_env=None):
    """A cpu_serve server for `model` with `flags`. plugins=False runs plain SGLang (no plugin); a
    string is SGLang's plugin whitelist (SGLANG_PLUGINS), e.g. the CPU harness alone at --tp 2."""
    env = {**child_env(), **(extra_env or {})}
    env.pop("_SGLANG_OEA_CONFIG", None)
    if plugins is not True:
        env["SGLANG_PLUGINS"] = plugins or "none-loaded"  # SGLang's whitelist; an unknown name loads none
    # A model written with --random-weights is loaded from its checkpoint; the others get dummy weights.
    weights = () if os.path.exists(os.path.join(model, "model.safetensors")) else ("--load-format", "dummy")
    for attempt in range(3):  # another process may take the free port before the server binds it
        port = free_port()
        log = str(tmp_path_factory.mktemp("server") / "server.log")
        cmd = [sys.executable, "-m", "sglang_oea.cpu_serve", "--model-path", model, *weights,
               "--host", "127.0.0.1", "--port", str(port), "--random-seed", "0", *flags]
        server = Server(cmd, log, env)
        try:
            wait_ready(f"http://127.0.0.1:{port}", 400, server.proc, log)
            break
        except PortTakenError:
            server.stop()
            if attempt == 2:
                raise
        except BaseException:
            server.stop()
            raise
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        server.stop()


def post(url, payload, timeout=300):
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def complete(base, prompt, max_tokens=16, **extra):
    payload = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return json.loads(post(base + "/v1/completions", payload))


def greedy_texts(base):
    return [complete(base, p)["choices"][0]["text"] for p in PROMPTS]


def concurrent(base, count, max_tokens):
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: complete(base, f"{PROMPTS[i % 4]} {i}", max_tokens, ignore_eos=True), range(count)))


def scrape(base):
    """{(name, frozenset(labels)): value} of the whole /metrics page."""
    out = {}
    for line in urllib.request.urlopen(base + "/metrics", timeout=30).read().decode().splitlines():
        match = re.match(r"^([^#\s{]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            out[(match.group(1), labels)] = float(match.group(3))
    return out


def oea_value(metrics, name, **labels):
    """Sum of a metric's samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


# ----------------------------------------------------------------------------- qwen3_moe (softmax)


@pytest.fixture(scope="module")
def plain_qwen(tmp_path_factory, models):
    with serve(tmp_path_factory, models["qwen3_moe_weighted"], "--enable-metrics", plugins=False) as (base, _):
        plain = {"texts": greedy_texts(base), "metric_names": {n for n, _ in scrape(base)}}
    return plain


def test_plugin_installed_but_off_changes_nothing(tmp_path_factory, models, plain_qwen):
    with serve(tmp_path_factory, models["qwen3_moe_weighted"], "--enable-metrics") as (base, log):
        assert greedy_texts(base) == plain_qwen["texts"]
        names = {n for n, _ in scrape(base)}
    assert not any("oea" in n for n in names)
    assert names == plain_qwen["metric_names"]
    assert "sglang-oea rank" not in open(log).read()


def test_k0_at_least_top_k_is_identical_to_plain(tmp_path_factory, models, plain_qwen):
    with serve(tmp_path_factory, models["qwen3_moe_weighted"], "--oea-k0", str(TOP_K), "--oea-min-batch", "1") as (base, log):
        assert greedy_texts(base) == plain_qwen["texts"]
    assert "OEA no-op (k0 >= top-k)" in open(log).read()


@pytest.fixture(scope="class")
def oea_qwen(tmp_path_factory, models):
    flags = ("--oea-k0", "4", "--oea-min-batch", "3", "--enable-metrics", "--decode-log-interval", "1")
    with serve(tmp_path_factory, models["qwen3_moe"], *flags) as running:
        yield running


class TestQwenWithOEA:
    """One OEA server for these tests (class scope: it stops before the glm servers start)."""

    def test_openai_endpoints(self, oea_qwen):
        check_openai_endpoints(oea_qwen)

    def test_concurrent_decode_goes_through_oea(self, oea_qwen):
        check_concurrent_decode(oea_qwen)


def check_openai_endpoints(oea_qwen):
    base, log = oea_qwen
    chat = json.loads(post(base + "/v1/chat/completions", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}))
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] > 0
    assert complete(base, "hello", 8)["usage"]["completion_tokens"] > 0
    payload = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
    stream = post(base + "/v1/completions", payload)
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(chunks) >= 2 and stream.rstrip().endswith("data: [DONE]")
    assert chunks[-1]["usage"]["completion_tokens"] == 8, "tokens may be grouped into fewer chunks; the usage counts them"
    assert "sglang-oea rank 0: OEA on, k0=4 min_batch=3" in open(log).read()


def check_concurrent_decode(oea_qwen):
    """Steps below min-batch are skipped, concurrent decode is routed with fewer experts."""
    base, _ = oea_qwen
    start = scrape(base)
    complete(base, "alone", 12, ignore_eos=True)  # 11 decode steps at B=1 < min batch 3
    alone = scrape(base)
    below = oea_value(alone, "sglang:oea_decode_steps_skipped_total", reason="below_min_batch") - oea_value(start, "sglang:oea_decode_steps_skipped_total", reason="below_min_batch")
    assert 11 <= below <= 13  # /health may add a request of its own
    assert oea_value(alone, "sglang:oea_decode_steps_applied_total") == oea_value(start, "sglang:oea_decode_steps_applied_total")

    results = concurrent(base, 6, 20)
    assert all(r["usage"]["completion_tokens"] == 20 for r in results)
    after = scrape(base)
    applied = oea_value(after, "sglang:oea_decode_steps_applied_total") - oea_value(alone, "sglang:oea_decode_steps_applied_total")
    assert applied >= 10
    assert oea_value(after, "sglang:oea_k0") == 4
    layers = {dict(ls)["layer"] for n, ls in after if n == "sglang:oea_active_experts_before"}
    assert layers == {"0", "1"}
    for layer in layers:
        before = oea_value(after, "sglang:oea_active_experts_before", layer=layer)
        expert_after = oea_value(after, "sglang:oea_active_experts_after", layer=layer)
        assert 4 <= expert_after < before <= min(NUM_EXPERTS, 7 * TOP_K)
    assert 0 < oea_value(after, "sglang:oea_active_experts_ratio") < 1
    decode_lines = [line for line in open(oea_qwen[1]) if "Decode batch" in line]
    assert any(re.search(r"OEA k0=4: applied \d+/\d+ decode steps, experts/layer/step [\d.]+ -> [\d.]+", line) for line in decode_lines)


# ----------------------------------------------------------------------------- glm4_moe (sigmoid + bias, groups, shared)


@pytest.fixture(scope="module")
def plain_glm(tmp_path_factory, models):
    with serve(tmp_path_factory, models["glm4_moe"], plugins=False) as (base, _):
        texts = greedy_texts(base)
    return texts


def test_glm_k0_at_least_top_k_is_identical_to_plain(tmp_path_factory, models, plain_glm):
    with serve(tmp_path_factory, models["glm4_moe"], "--oea-k0", "9") as (base, _):
        assert greedy_texts(base) == plain_glm


def test_glm_serves_with_oea_and_records_router_logits(tmp_path_factory, models):
    dump = str(tmp_path_factory.mktemp("dump"))
    flags = ("--oea-k0", "3", "--oea-min-batch", "2", "--enable-metrics", "--decode-log-interval", "1",
             "--oea-dump-router-logits", dump, "--oea-dump-steps", "3")
    with serve(tmp_path_factory, models["glm4_moe"], *flags) as (base, log):
        chat = json.loads(post(base + "/v1/chat/completions", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}))
        assert chat["usage"]["completion_tokens"] > 0
        concurrent(base, 5, 16)
        metrics = scrape(base)
    assert "routing=sigmoid+bias, groups 4/8" in open(log).read()
    assert oea_value(metrics, "sglang:oea_decode_steps_applied_total") >= 8
    # Dummy weights give the correction bias a random, dominant spread, so every token may pick the
    # same experts (before == k); OEA can then only keep T, never raise it.
    before = oea_value(metrics, "sglang:oea_active_experts_before", layer="0")
    after = oea_value(metrics, "sglang:oea_active_experts_after", layer="0")
    assert TOP_K <= after <= before, (before, after)
    check_router_dump(dump)


def check_router_dump(dump):
    """Bounded: 3 decode steps x 2 layers, with the router's settings; the simulator reads them."""
    import torch

    files = sorted(os.listdir(dump))
    steps = {name.split("_")[1] for name in files}
    assert len(steps) == 3 and len(files) == 3 * 2
    record = torch.load(os.path.join(dump, files[0]))
    assert record["router_logits"].shape == (record["batch_size"], NUM_EXPERTS)
    assert (record["scoring_func"], record["num_expert_group"], record["topk_group"], record["top_k"]) == ("sigmoid", 8, 4, TOP_K)
    assert record["correction_bias"].shape == (NUM_EXPERTS,)
    here = os.path.dirname(os.path.abspath(__file__))
    simulate = os.path.join(here, "..", "..", "benchmark", "oea", "simulate.py")
    proc = subprocess.run([sys.executable, simulate, "--dump-dir", dump, "--k0", "3", "--out-dir", os.path.join(dump, "sim")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
