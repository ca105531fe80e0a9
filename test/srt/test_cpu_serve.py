"""cpu_serve's memory defaults (no server): the KV pool is sized in tokens and SGLang's start-up
memory check passes whatever RAM is free when the server starts.

SGLang 0.5.23 on the CPU reads free RAM before the weights load (`pre`) and again when it sizes the
KV pool (`now`), and refuses to start when now - pre * (1 - --mem-fraction-static) <= 0
(KVCacheConfigurator._profile_available_bytes). The two tests of SGLang's own code below run that
function and the token cap (_apply_token_constraints) with the memory readings faked.
"""

from types import SimpleNamespace as NS
from unittest import mock

import pytest

import sglang.srt.mem_cache.kv_cache_configurator as kvc
from sglang.srt.server_args import prepare_server_args
from sglang_oea.cpu import serve as cpu_serve
from sglang_oea.cpu.serve import CPU_DEFAULTS, serve_command, with_cpu_defaults

DEFAULTS = dict(CPU_DEFAULTS)
FRACTION, TOKENS = float(DEFAULTS["--mem-fraction-static"]), int(DEFAULTS["--max-total-tokens"])
# What the scheduler grows by between SGLang's two readings, measured on the 2-core test host: about
# 1.8 GiB with NGRAM (its n-gram corpus, 10M entries by default, is built in between), 0.1 GiB
# without. 2.5 GiB leaves a margin.
GROWTH_GIB = 2.5


def profile(fraction, pre_gib, now_gib):
    """SGLang's KV budget in bytes for these free-RAM readings (GiB), or its ValueError."""
    runner = NS(device="cpu", gpu_id=0, mambaish_config=None, post_capture_kv_active=False,
                model_config=NS(is_multimodal=False))
    schedule = NS(mem_fraction_static=fraction, prefill_max_requests=None, max_mamba_cache_size=None)
    with mock.patch.object(kvc, "get_available_gpu_memory", lambda *a, **k: now_gib), \
            mock.patch.object(kvc, "get_schedule", lambda: schedule), \
            mock.patch.object(kvc, "get_parallel", lambda: NS(launch_world_size=1, world_group=NS(cpu_group=None))), \
            mock.patch.object(kvc, "get_exec", lambda: NS(graph=NS(cuda_graph_config=NS(
                prefill=NS(full_prefill_max_req=None, backend=None))))), \
            mock.patch.object(kvc, "get_disagg", lambda: NS(disaggregation_mode="null")), \
            mock.patch.object(kvc, "get_mm", lambda: NS(mm_feature_transport=None)):
        return kvc.KVCacheConfigurator._profile_available_bytes(runner, pre_gib)


def test_old_fraction_fails_as_in_the_issue():
    """The fake readings reproduce the issue's refusal: 0.1 with 18 GiB free and NGRAM's growth."""
    with pytest.raises(ValueError, match=r"leave no GPU memory .*minimum viable = 1 - available/pre = 0\.1008"):
        profile(0.1, 18.0, 18.0 - 1.815)


@pytest.mark.parametrize("free_gib", [4, 6, 10, 18, 24, 64])
def test_default_fraction_passes_whatever_is_free(free_gib):
    budget = profile(FRACTION, free_gib, free_gib - GROWTH_GIB)
    # Room for the token cap's pool 4 times over (the test models take 1 KiB per token).
    assert budget > 4 * TOKENS * 1024


def test_pool_is_the_token_cap_when_the_budget_is_larger():
    with mock.patch.object(kvc, "get_schedule", lambda: NS(max_total_tokens=TOKENS)), \
            mock.patch.object(kvc, "get_parallel", lambda: NS(pp_size=1)):
        assert kvc.KVCacheConfigurator._apply_token_constraints(None, 10 * TOKENS) == TOKENS


def test_sglang_parses_the_defaults():
    args = prepare_server_args(with_cpu_defaults(["--model-path", "/nonexistent"]))
    assert (args.device, args.attention_backend) == ("cpu", "torch_native")
    assert (args.mem_fraction_static, args.max_total_tokens) == (FRACTION, TOKENS)


def test_the_caller_flags_win():
    argv = ["--model-path", "m", "--mem-fraction-static=0.3", "--max-total-tokens", "4096"]
    out = with_cpu_defaults(argv)
    assert out[:len(argv)] == argv
    assert not any(a.startswith(("--mem-fraction-static", "--max-total-tokens")) for a in out[len(argv):])
    assert "--device" in out and serve_command(argv)[-len(out):] == out


@pytest.mark.parametrize("tp, expected", [("1", None), ("2", "0")])
def test_tp_turns_the_memory_balance_error_into_a_warning(monkeypatch, tp, expected):
    """Ranks of one CPU host share its RAM: SGLang's per-rank balance check only sees timing."""
    seen = {}
    monkeypatch.delenv("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", raising=False)
    monkeypatch.setattr(cpu_serve.os, "execve", lambda path, cmd, env: seen.update(env))
    cpu_serve.main(["--model-path", "m", "--tp", tp])
    assert seen.get("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK") == expected
