"""The --oea-* flags: parsing, defaults, the deprecated variable, and every startup refusal."""

import argparse
import atexit
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flags_probe
from sglang_oea import flags, hooks
from sglang_oea.config import DEFAULT_MIN_BATCH, MAX_BATCH, MAX_ROWS_PER_REQUEST, LiveSettings, OEAConfig, build_config
from sglang_oea.cpu.serve import cpu_environment
from sglang_oea.cpu.tiny_model import main as write_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe"))
    write_tiny_model(["--arch", "qwen3_moe", "--out", out, "--num-experts", "16", "--top-k", "4", "--num-layers", "1", "--hidden-size", "64", "--moe-intermediate-size", "32"])
    return out


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory, moe_model):
    out = str(tmp_path_factory.mktemp("dense"))
    config = json.load(open(os.path.join(moe_model, "config.json")))
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        config.pop(key)
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    return out


def parse(argv, environ=None):
    parser = argparse.ArgumentParser()
    flags.add_oea_arguments(parser)
    return flags.config_from_namespace(parser.parse_args(argv), environ or {})


def settings(model, **overrides):
    values = {"model_path": model, "moe_runner_backend": "auto", "ep_size": 1, "dp_size": 1, "attn_dp_size": 1, "enable_dp_attention": False, "use_ray": False}
    values.update(overrides)
    return lambda name, default: values.get(name, default)


# ----------------------------------------------------------------------------- parsing


def test_defaults_mean_off():
    cfg = parse([])
    assert cfg == OEAConfig() and not cfg.enabled
    assert cfg.min_batch == DEFAULT_MIN_BATCH and cfg.max_batch == 0


def test_all_flags_parse():
    cfg = parse(["--oea-k0", "5", "--oea-min-batch", "8", "--oea-max-batch", "64", "--oea-disable-stats", "--oea-kernel", "torch",
                 "--oea-dump-router-logits", "/tmp/d", "--oea-dump-steps", "3", "--oea-check-ranks", "50", "--oea-verify", "off"])
    assert cfg == OEAConfig(k0=5, min_batch=8, max_batch=64, stats=False, kernel="torch", dump_router_logits="/tmp/d",
                            dump_steps=3, check_ranks=50, verify=False)
    assert "check_ranks=50" in cfg.describe() and "check_ranks=off" in OEAConfig(k0=5).describe()
    assert cfg.describe().endswith("verify=off") and OEAConfig(k0=5).describe().endswith("verify=on")
    assert parse(["--oea-k0", "5", "--oea-verify", "on"]).verify and parse(["--oea-k0", "5"]).verify


def test_k0_zero_installs_oea_off():
    """--oea-k0 0 arms OEA (installed, checked like any k0) and leaves it off until a live change."""
    cfg = parse(["--oea-k0", "0", "--oea-min-batch", "2", "--oea-dump-router-logits", "/tmp/d", "--oea-check-ranks", "5"])
    assert cfg.enabled and cfg.k0 == 0 and cfg.live() == LiveSettings(0, 2, 0)
    assert not OEAConfig().enabled and OEAConfig().live() == LiveSettings(0, DEFAULT_MIN_BATCH, 0)
    assert build_config({"oea_k0": 0}).enabled, "sglang.Engine(oea_k0=0) likewise"
    assert hooks.startup_state(0, None).startswith('armed, off (k0=0) until POST /set_internal_state {"server_args"')


@pytest.mark.parametrize("argv,message", [
    (["--oea-dump-router-logits", "/tmp/d"], "--oea-dump-router-logits records only with --oea-k0 set"),
    (["--oea-check-ranks", "10"], "--oea-check-ranks compares the experts OEA chose, so it needs --oea-k0"),
])
def test_settings_that_act_only_with_oea_on_are_refused_without_k0(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(argv)


@pytest.mark.parametrize("found", ["0.5.23", "0.5.23.post1", "0.5.23+cu130", "0.5.23.post2+cu129"])
def test_every_build_of_sglang_0_5_23_is_accepted(found):
    flags.check_sglang_version(found)


@pytest.mark.parametrize("found", ["0.5.22", "0.5.24", "0.5.23rc1", "0.5.23.dev0", "0.6.0", "not installed"])
def test_other_sglang_releases_and_pre_releases_are_refused(found):
    with pytest.raises(ValueError, match=rf"--oea-k0 needs an sglang 0.5.23 build .*this environment has sglang {re.escape(found)}$"):
        flags.check_sglang_version(found)


def test_the_wheel_requires_what_the_startup_check_accepts():
    """pip and the startup check apply one rule: the wheel's requirement is the check's spec, and
    the spec admits exactly the builds the check accepts."""
    from packaging.specifiers import SpecifierSet

    pyproject = (Path(__file__).resolve().parents[2] / "python" / "pyproject.toml").read_text()
    assert f'dependencies = ["sglang{flags.SUPPORTED_SGLANG_SPEC}"]' in pyproject
    spec = SpecifierSet(flags.SUPPORTED_SGLANG_SPEC)
    for found in ["0.5.23", "0.5.23.post1", "0.5.23+cu130", "0.5.22", "0.5.24", "0.5.23rc1", "0.5.24rc1"]:
        assert spec.contains(found) == flags.supported_sglang(found), found
    assert flags.supported_sglang(flags.installed_sglang_version())


@pytest.mark.parametrize("flag,value,choices", [
    ("--oea-kernel", "cuda", "'auto', 'triton', 'torch'"),
    ("--oea-verify", "yes", "'on', 'off'"),
])
def test_bad_choices_are_refused_by_the_parser(flag, value, choices, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["--oea-k0", "3", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and choices in err


def test_bad_choices_are_refused_by_the_config():
    with pytest.raises(ValueError, match="--oea-kernel must be one of auto, triton, torch, got 'cuda'"):
        OEAConfig(k0=3, kernel="cuda")
    with pytest.raises(ValueError, match=r"--oea-verify \(oea_verify\) must be one of on, off \(or True / False\), got 'yes'"):
        build_config({"oea_k0": 3, "oea_verify": "yes"})
    with pytest.raises(ValueError, match="--oea-verify must be on or off"):
        OEAConfig(k0=3, verify=1)
    assert build_config({"oea_k0": 3, "oea_verify": False}).verify is False
    assert build_config({"oea_k0": 3, "oea_verify": "off"}).verify is False


@pytest.mark.parametrize("argv,flag", [
    (["--oea-k0", "-3"], "--oea-k0"),
    (["--oea-k0", "2.5"], "--oea-k0"),
    (["--oea-k0", "four"], "--oea-k0"),
    (["--oea-min-batch", "0"], "--oea-min-batch"),
    (["--oea-max-batch", "-1"], "--oea-max-batch"),
    (["--oea-dump-steps", "0"], "--oea-dump-steps"),
    (["--oea-check-ranks", "-1"], "--oea-check-ranks"),
    (["--oea-k0", "65"], "--oea-k0"),
    (["--oea-k0", str(2 ** 31)], "--oea-k0"),
    (["--oea-min-batch", "65537"], "--oea-min-batch"),
    (["--oea-max-batch", str(2 ** 31)], "--oea-max-batch"),
])
def test_bad_values_are_refused_by_the_parser(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "must be an integer " in err


def test_every_setting_has_an_upper_bound_and_the_largest_values_parse():
    """The settings live in an int32 device control block: each has a stated upper bound."""
    cfg = parse(["--oea-k0", "64", "--oea-min-batch", "65536", "--oea-max-batch", "65536"])
    assert (cfg.k0, cfg.min_batch, cfg.max_batch) == (64, 65536, 65536)
    for field, value, message in (("k0", 65, "--oea-k0 must be an integer from 0 to 64, got 65"),
                                  ("min_batch", 65537, "--oea-min-batch must be an integer from 1 to 65536, got 65537"),
                                  ("max_batch", 2 ** 31, "--oea-max-batch must be an integer from 0 to 65536, got 2147483648")):
        with pytest.raises(ValueError, match=message):
            OEAConfig(**{"k0": 2, field: value})
    assert MAX_BATCH * MAX_ROWS_PER_REQUEST < 2 ** 31, "min_batch x draft tokens fits the device gate's int32"


def test_max_batch_below_min_batch_is_refused():
    with pytest.raises(ValueError, match=r"--oea-max-batch must be 0 \(no cap\) or >= --oea-min-batch \(8\), got 4"):
        parse(["--oea-k0", "3", "--oea-min-batch", "8", "--oea-max-batch", "4"])


def test_config_object_refuses_non_integers():
    with pytest.raises(ValueError, match="--oea-k0 must be an integer from 0 to 64, got 2.0"):
        OEAConfig(k0=2.0)
    with pytest.raises(ValueError, match="--oea-k0 must be an integer from 0 to 64, got True"):
        OEAConfig(k0=True)
    with pytest.raises(ValueError, match="--oea-min-batch"):
        OEAConfig(k0=2, min_batch=True)


def test_deprecated_environment_variable(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = build_config({}, {"SGLANG_OEA_K0": "4"})
    assert cfg.k0 == 4
    assert "SGLANG_OEA_K0 is deprecated" in caplog.text and "--oea-k0 4" in caplog.text
    assert build_config({"oea_k0": 6}, {"SGLANG_OEA_K0": "4"}).k0 == 6, "the flag wins"
    with pytest.raises(ValueError, match="SGLANG_OEA_K0 must be an integer from 1 to 64, got 'x'"):
        build_config({}, {"SGLANG_OEA_K0": "x"})


# ----------------------------------------------------------------------------- server refusals


def test_valid_server_passes_and_reports_shape(moe_model):
    shape = flags.validate_server(OEAConfig(k0=2), settings(moe_model), lambda: json.load(open(f"{moe_model}/config.json")))
    assert (shape.num_experts, shape.top_k, shape.family) == (16, 4, "softmax")


def test_startup_check_loads_the_config_of_the_served_revision(moe_model, monkeypatch):
    """The model check reads the config SGLang will load: --revision and --trust-remote-code go through."""
    import transformers

    calls = []
    real = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda path, **kw: calls.append((path, kw)) or real(path, **kw))
    hooks.validate_for_server(OEAConfig(k0=2), settings(moe_model, revision="v2-router", trust_remote_code=True))
    assert calls == [(moe_model, {"trust_remote_code": True, "revision": "v2-router"})]
    calls.clear()
    hooks.validate_for_server(OEAConfig(k0=2), settings(moe_model))
    assert calls == [(moe_model, {"trust_remote_code": False, "revision": None})]


@pytest.mark.parametrize("overrides,message", [
    ({"ep_size": 2}, "--ep-size 1 only"),
    ({"enable_dp_attention": True, "enable_dp_attention_local_control_broadcast": True},
     "with DP attention does not support --enable-dp-attention-local-control-broadcast: each attention-DP group"),
    ({"attn_dp_size": 2, "enable_two_batch_overlap": True}, "does not support --enable-two-batch-overlap"),
    ({"attn_dp_size": 2, "enable_single_batch_overlap": True}, "does not support --enable-single-batch-overlap"),
    ({"attn_dp_size": 2, "attn_cp_size": 2}, "with DP attention supports --attn-cp-size 1 only, got 2"),
    ({"attn_dp_size": 2, "dwdp_size": 2}, "with DP attention supports --dwdp-size 1 only, got 2"),
    ({"use_ray": True}, "--use-ray"),
    ({"moe_a2a_backend": "deepep"}, r"--moe-a2a-backend none only \(all-to-all expert dispatch is expert parallel, .*got deepep"),
    ({"moe_runner_backend": "flashinfer_trtllm"}, "--moe-runner-backend flashinfer_trtllm .* use --moe-runner-backend triton"),
    ({"moe_runner_backend": "triton_kernel"}, "--moe-runner-backend triton_kernel"),
    ({"moe_runner_backend": "flashinfer_mxfp4"}, "--moe-runner-backend flashinfer_mxfp4"),
    ({"moe_runner_backend": "experimental_sgl_trtllm"}, "--moe-runner-backend experimental_sgl_trtllm routes inside"),
    ({"enable_deterministic_inference": True}, "cannot be combined with --enable-deterministic-inference"),
    ({"enable_pdmux": True}, "does not support --enable-pdmux"),
])
def test_unsupported_configurations_are_refused(moe_model, overrides, message):
    with pytest.raises(ValueError, match=message):
        flags.validate_server(OEAConfig(k0=2), settings(moe_model, **overrides), lambda: {})


@pytest.mark.parametrize("overrides", [{"dp_size": 2}, {"dp_size": 2, "nnodes": 2, "node_rank": 1, "tp_size": 4},
                                       {"tp_size": 2, "attn_dp_size": 2}, {"tp_size": 2, "enable_dp_attention": True}])
def test_data_parallel_replicas_nodes_and_dp_attention_are_accepted(moe_model, overrides):
    """Each DP replica routes its own batch; TP across nodes is TP; under DP attention every rank
    routes the gathered batch (docs/scale-out.md)."""
    shape = flags.validate_server(OEAConfig(k0=2), settings(moe_model, **overrides), lambda: json.load(open(f"{moe_model}/config.json")))
    assert shape.top_k == 4


def test_dp_attention_refused_when_the_ranks_skip_the_token_count_exchange():
    get = settings("unused", attn_dp_size=2)
    flags.check_dp_attention(get, {})  # accepted without it
    with pytest.raises(ValueError, match="cannot run with SGLANG_SCHEDULER_SKIP_ALL_GATHER set"):
        flags.check_dp_attention(get, {flags.SKIP_ALL_GATHER_ENV: "1"})


def test_model_without_routed_experts_is_refused(dense_model):
    config = json.load(open(f"{dense_model}/config.json"))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model with routed experts"):
        flags.validate_server(OEAConfig(k0=2), settings(dense_model), lambda: config)


def test_unsupported_router_scoring_is_refused(moe_model):
    config = dict(json.load(open(f"{moe_model}/config.json")), scoring_func="sqrtsoftplus")
    with pytest.raises(ValueError, match="uses scoring_func 'sqrtsoftplus'"):
        flags.validate_server(OEAConfig(k0=2), settings(moe_model), lambda: config)


def test_k0_at_least_top_k_is_logged_as_noop(moe_model, caplog):
    with caplog.at_level(logging.WARNING):
        flags.validate_server(OEAConfig(k0=4), settings(moe_model), lambda: json.load(open(f"{moe_model}/config.json")))
    assert "OEA is a no-op" in caplog.text


def test_hidden_topk_advice_names_backends_that_run_fp4():
    with pytest.raises(ValueError) as exc:
        flags.check_backend("flashinfer_trtllm")
    advice = str(exc.value)
    assert "flashinfer_cutlass (modelopt_fp4" in advice and "cutlass /" not in advice


@pytest.mark.parametrize("resolved,quantization,want", [
    ("flashinfer_trtllm", None, "triton"),
    ("flashinfer_trtllm", "fp8", "triton"),
    ("flashinfer_trtllm", "modelopt_fp4", "flashinfer_cutlass"),
    ("experimental_sgl_trtllm", "modelopt_fp8", "flashinfer_cutlass"),
    ("flashinfer_trtllm", "modelopt_mixed", "flashinfer_cutlass"),
    ("flashinfer_cutlass", "modelopt_fp4", None),
    ("triton", None, None),
])
def test_auto_fallback_runs_the_quantization(resolved, quantization, want):
    assert flags.fallback_backend(resolved, quantization) == want


@pytest.mark.parametrize("resolved,quantization", [("flashinfer_trtllm", "nvfp4_online"), ("flashinfer_mxfp4", "mxfp4"),
                                                   ("flashinfer_trtllm", "mxfp8")])
def test_auto_fallback_refuses_without_a_known_backend(resolved, quantization):
    with pytest.raises(ValueError, match=f"auto chose {resolved}.*--quantization {quantization}; pass one that keeps top-k ids"):
        flags.fallback_backend(resolved, quantization)


@pytest.fixture
def auto_resolves_to_trtllm(monkeypatch):
    """SGLang's own resolution pipeline, with `auto` resolving to flashinfer_trtllm as it does for
    DeepSeek-style models on SM100 (this machine has no GPU to make it do so)."""
    from sglang.srt.arg_groups import moe_hook

    def quant_constraints(view):
        return {"moe_runner_backend": "flashinfer_trtllm"}

    monkeypatch.setattr(moe_hook, "_moe_runner_backend_quant_constraints", quant_constraints)
    monkeypatch.setenv(hooks.CONFIG_ENV, "")
    hooks.install()


def test_resolution_replaces_an_auto_backend_that_hides_ids(moe_model, auto_resolves_to_trtllm, capfd):
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", moe_model, "--device", "cpu", "--oea-k0", "3"])
    server_args.resolve_once()
    assert resolved_view(server_args).moe_runner_backend == "triton"
    err = capfd.readouterr().err  # SGLang's logging setup replaces the root handlers (no caplog)
    assert "auto chose flashinfer_trtllm" in err and "using triton (quantization None)" in err
    plain = prepare_server_args(["--model-path", moe_model, "--device", "cpu"])
    plain.resolve_once()
    assert resolved_view(plain).moe_runner_backend == "flashinfer_trtllm", "OEA off: SGLang's choice stands"


def test_resolution_refusal_is_one_line_on_the_command_line(moe_model, auto_resolves_to_trtllm, monkeypatch):
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(flags, "FALLBACK_BY_QUANTIZATION", {})
    server_args = prepare_server_args(["--model-path", moe_model, "--device", "cpu", "--oea-k0", "3"])
    with pytest.raises(SystemExit) as exc:
        server_args.resolve_once()
    assert str(exc.value).startswith("sglang-oea: error: --oea-k0 needs top-k ids, but --moe-runner-backend auto chose "
                                     "flashinfer_trtllm")


@pytest.fixture
def oea_hooks(monkeypatch):
    monkeypatch.setenv(hooks.CONFIG_ENV, "")  # restored after the test: the hooks publish into it
    hooks.install()


def test_resolved_all_to_all_dispatch_is_refused(moe_model, oea_hooks):
    """--enable-waterfill makes SGLang's resolution choose the deepep all-to-all backend, and with it
    ep_size = tp_size: neither flag was given, so only the resolved values show it."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", moe_model, "--device", "cpu", "--tp", "2", "--enable-waterfill"]
    plain = prepare_server_args(argv)
    plain.resolve_once()
    view = resolved_view(plain)
    assert (plain.moe_a2a_backend, plain.ep_size) == ("none", 1) and (view.moe_a2a_backend, view.ep_size) == ("deepep", 2)
    server_args = prepare_server_args([*argv, "--oea-k0", "3"])
    with pytest.raises(SystemExit) as exc:
        server_args.resolve_once()
    assert str(exc.value) == ("sglang-oea: error: --oea-k0 supports --moe-a2a-backend none only (all-to-all expert "
                              "dispatch is expert parallel, which is not supported yet); SGLang's argument resolution "
                              "chose deepep")


def test_resolved_expert_parallel_is_refused(moe_model, oea_hooks):
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", moe_model, "--device", "cpu", "--oea-k0", "3"])
    server_args.resolve_once()
    hooks.check_resolved_arguments(server_args)  # the defaults pass
    declare_resolution(server_args, "test", ep_size=4)  # as a resolution step would
    with pytest.raises(hooks.OEAStartupError, match=r"--ep-size 1 only .*got 4 \(after SGLang's argument resolution\)"):
        hooks.check_resolved_arguments(server_args)


def test_a_cap_no_verify_pass_can_pass_is_refused_after_resolution(moe_model, oea_hooks):
    """--oea-max-batch counts rows: 8 rows is below 4 requests x 4 draft tokens, so OEA would
    apply in no verify pass. SGLang resolves --speculative-num-draft-tokens (EAGLE: 4 by default),
    so the check runs on the resolved arguments, from the command line in one line."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", moe_model, "--device", "cpu", "--speculative-algorithm", "NGRAM",
            "--speculative-num-draft-tokens", "4", "--oea-k0", "3", "--oea-min-batch", "4"]
    prepare_server_args([*argv, "--oea-max-batch", "16"]).resolve_once()  # 4 requests of 4 tokens: passes
    with pytest.raises(SystemExit) as exc:
        prepare_server_args([*argv, "--oea-max-batch", "8"]).resolve_once()
    assert str(exc.value) == ("sglang-oea: error: --oea-max-batch 8 rows is below --oea-min-batch 4 requests x 4 draft "
                              "tokens, so OEA would apply in no verify pass; give --oea-max-batch at least 16 (or 0, "
                              "no cap), or turn OEA off with k0 0")
    prepare_server_args([*argv, "--oea-max-batch", "8", "--oea-verify", "off"]).resolve_once()  # verify not routed


@pytest.mark.parametrize("graph_flags", [["--cuda-graph-backend-decode", "breakable"],
                                         ["--cuda-graph-backend-decode", "breakable", "--debug-cuda-graph"],
                                         ["--speculative-algorithm", "EAGLE", "--speculative-adaptive"]])
def test_graph_backends_and_adaptive_speculation_are_accepted(moe_model, oea_hooks, graph_flags):
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", moe_model, "--device", "cpu", "--oea-k0", "3", *graph_flags])
    server_args.resolve_once()
    assert server_args._oea["k0"] == 3


def test_verify_widths_of_adaptive_speculative_decoding():
    """One verify runner per adaptive candidate (SGLang's default candidate steps 0, 1, 3, 5, 7)."""
    from types import SimpleNamespace

    from sglang_oea.startup_checks import verify_widths

    assert verify_widths(SimpleNamespace(speculative_algorithm=None)) == ()
    assert verify_widths(SimpleNamespace(speculative_algorithm="EAGLE", speculative_adaptive=False,
                                         speculative_num_draft_tokens=4)) == (4,)
    assert verify_widths(SimpleNamespace(speculative_algorithm="EAGLE", speculative_adaptive=True,
                                         speculative_adaptive_config=None)) == (1, 2, 4, 6, 8)


def test_engine_refuses_resolved_all_to_all_dispatch(moe_model, oea_hooks, monkeypatch):
    import sglang

    # Engine.__init__ registers its shutdown at exit before it resolves the arguments; nothing to shut down here.
    monkeypatch.setattr(atexit, "register", lambda fn, *args, **kwargs: fn)
    with pytest.raises(hooks.OEAStartupError, match="SGLang's argument resolution chose deepep"):
        sglang.Engine(model_path=moe_model, device="cpu", tp_size=2, enable_waterfill=True, oea_k0=2)


def test_speculative_decoding_says_whether_verify_passes_are_routed(moe_model, caplog):
    load = lambda: json.load(open(f"{moe_model}/config.json"))  # noqa: E731
    with caplog.at_level(logging.INFO):
        flags.validate_server(OEAConfig(k0=2), settings(moe_model, speculative_algorithm="EAGLE"), load)
    assert "--speculative-algorithm EAGLE: OEA routes the target model's verify passes" in caplog.text
    assert "WARNING" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        flags.validate_server(OEAConfig(k0=2, verify=False), settings(moe_model, speculative_algorithm="NGRAM"), load)
    assert "--oea-verify off with --speculative-algorithm NGRAM" in caplog.text and "OEA is applied nowhere" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        flags.validate_server(OEAConfig(k0=2), settings(moe_model), load)
    assert "speculative" not in caplog.text


def test_compact_ragged_verify_is_refused_with_verify_on():
    compact = {flags.RAGGED_VERIFY_ENV: "compact"}
    with pytest.raises(ValueError, match="--oea-verify on does not support SGLANG_RAGGED_VERIFY_MODE=compact"):
        flags.check_speculative(OEAConfig(k0=2), "DSPARK", compact)
    flags.check_speculative(OEAConfig(k0=2, verify=False), "DSPARK", compact)
    flags.check_speculative(OEAConfig(k0=2), "DSPARK", {})
    flags.check_speculative(OEAConfig(k0=2), "EAGLE", compact)  # only DSPARK verifies ragged batches


def test_triton_kernel_needs_cuda(moe_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    load = lambda: json.load(open(f"{moe_model}/config.json"))  # noqa: E731
    with pytest.raises(ValueError, match="--oea-kernel triton needs a CUDA device"):
        flags.validate_server(OEAConfig(k0=2, kernel="triton"), settings(moe_model, device="cpu"), load)
    with pytest.raises(ValueError, match="--oea-kernel triton needs a CUDA device"):
        flags.validate_server(OEAConfig(k0=2, kernel="triton"), settings(moe_model), load, cuda_available=lambda: False)
    flags.validate_server(OEAConfig(k0=2, kernel="triton"), settings(moe_model), load, cuda_available=lambda: True)


def test_disabled_config_skips_all_checks(dense_model):
    assert flags.validate_server(OEAConfig(), settings(dense_model, ep_size=8), lambda: {}) is None


# ----------------------------------------------------------------------------- real SGLang entry points


def model_args(model):
    return ["--model-path", model, "--load-format", "dummy", "--device", "cpu"]


ROLES = ("scheduler", "detokenizer", "dp_controller", "launcher")
CLI_REFUSALS = [
    (["--oea-k0", "-1"], "argument --oea-k0: --oea-k0 must be an integer from 0 to 64, got -1"),
    (["--oea-k0", "2", "--oea-min-batch", "65537"], "--oea-min-batch must be an integer from 1 to 65536, got 65537"),
    (["--oea-k0", "3", "--ep-size", "2"], "sglang-oea: error: --oea-k0 supports --ep-size 1 only"),
    (["--oea-k0", "3", "--moe-runner-backend", "flashinfer_trtllm"], "sglang-oea: error: --oea-k0 needs top-k ids"),
    (["--oea-k0", "3", "--oea-kernel", "triton"], "sglang-oea: error: --oea-kernel triton needs a CUDA device"),
    (["--oea-k0", "3", "--moe-a2a-backend", "deepep"], "sglang-oea: error: --oea-k0 supports --moe-a2a-backend none only"),
]


@pytest.fixture(scope="module")
def entries(moe_model, dense_model):
    """The cases below that run a process entry of SGLang's (a role's entry up to its plugins, the
    launcher's command line, a process's first Engine), each in a fresh fork of one child that
    imports SGLang once (flags_probe.py): {case name: outcome}."""
    on = OEAConfig(k0=2).as_dict()
    cases = [{"name": f"role {role}", "kind": "role", "role": role, "config": on} for role in ROLES]
    cases += [{"name": f"role {role} without OEA", "kind": "role", "role": role, "config": None}
              for role in ("scheduler", "launcher")]
    cases += [{"name": " ".join(extra), "kind": "launch", "argv": [*model_args(moe_model), *extra]} for extra, _ in CLI_REFUSALS]
    cases += [{"name": "help", "kind": "launch", "argv": ["--help"]},
              {"name": "dense", "kind": "launch", "argv": [*model_args(dense_model), "--oea-k0", "2"]},
              {"name": "accepted", "kind": "launch", "argv": [*model_args(moe_model), "--oea-k0", "3"]},
              {"name": "first engine", "kind": "engine",
               "kwargs": {"model_path": moe_model, "oea_k0": 0, "oea_min_batch": 0}}]
    env = cpu_environment()
    env.pop(hooks.CONFIG_ENV, None)
    return flags_probe.probe(cases, env)


def outcome(entries, name):
    """The result of case `name`, with its stderr's end when it has none (it raised)."""
    run = entries[name]
    assert run["result"] is not None, f"case {name!r} (exit {run['status']}): {run['stderr'][-2000:]}"
    return run["result"]


def test_launch_server_help_lists_the_oea_group(entries):
    assert outcome(entries, "help") == {"code": 0, "launched": False}
    out = entries["help"]["stdout"]
    assert "Opportunistic Expert Activation (sglang-oea)" in out
    for flag in ("--oea-k0", "--oea-min-batch", "--oea-max-batch"):
        assert flag in out


@pytest.mark.parametrize("extra,message", CLI_REFUSALS)
def test_cli_refusals_exit_before_loading(entries, extra, message):
    """Refused with an error exit before the launcher starts the server (which loads the weights)."""
    result, err = outcome(entries, " ".join(extra)), entries[" ".join(extra)]["stderr"]
    assert result["code"] != 0 and not result["launched"], err[-2000:]
    assert message in err


def test_cli_probe_reaches_the_launch_when_nothing_is_refused(entries):
    """The control for the refusals: an accepted command line gets as far as starting the server."""
    assert outcome(entries, "accepted")["launched"], entries["accepted"]["stderr"][-2000:]
    assert "sglang-oea: error" not in entries["accepted"]["stderr"]


def test_cli_refuses_dense_model(entries):
    result, err = outcome(entries, "dense"), entries["dense"]["stderr"]
    assert result["code"] != 0 and not result["launched"]
    last = err.strip().splitlines()[-1]
    assert last.startswith("sglang-oea: error: --oea-k0 needs a mixture-of-experts model")


def run_launcher(args, timeout=240):
    env = cpu_environment()
    env.pop(hooks.CONFIG_ENV, None)
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_refuses_resolved_all_to_all_dispatch_in_one_line(moe_model):
    """A real `python -m sglang.launch_server` run, end to end."""
    proc = run_launcher([*model_args(moe_model), "--tp", "2", "--enable-waterfill", "--oea-k0", "2"])
    assert proc.returncode != 0
    assert proc.stderr.count("sglang-oea: error:") == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "sglang-oea: error: --oea-k0 supports --moe-a2a-backend none only (all-to-all expert dispatch is expert "
        "parallel, which is not supported yet); SGLang's argument resolution chose deepep")
    assert "Load weight" not in proc.stderr + proc.stdout


def test_engine_keyword_refusal(moe_model):
    hooks.install()
    import sglang

    with pytest.raises(ValueError, match="--oea-min-batch must be an integer from 1 to 65536"):
        sglang.Engine(model_path=moe_model, oea_k0=2, oea_min_batch=0)
    with pytest.raises(ValueError, match="unknown OEA keyword.*oea_stats; allowed: oea_k0"):
        sglang.Engine(model_path=moe_model, oea_k0=2, oea_stats=False)


@pytest.mark.parametrize("keywords,stats", [({"oea_disable_stats": True}, False), ({}, True), ({"oea_disable_stats": False}, True)])
def test_engine_keywords_behave_like_the_flags(moe_model, monkeypatch, keywords, stats):
    """Engine(oea_disable_stats=True) is --oea-disable-stats; no oea_* keyword reaches SGLang."""
    monkeypatch.setenv(hooks.CONFIG_ENV, "")  # restored after the test: the hook publishes into it
    record = hooks.engine_server_args(model_path=moe_model, oea_k0=2, oea_kernel="torch", oea_verify=stats, **keywords)
    assert record.model_path == moe_model, "the other keywords reach SGLang's ServerArgs"
    assert hooks.published_config() == OEAConfig(k0=2, stats=stats, kernel="torch", verify=stats)
    with pytest.raises(ValueError, match="oea_disable_stats\\) must be True or False, got 'yes'"):
        hooks.engine_server_args(model_path=moe_model, oea_k0=2, oea_disable_stats="yes")


def test_the_first_engine_of_a_process_takes_the_oea_keywords(entries):
    """sglang.Engine loads the plugins inside its own __init__: the keywords are read by the record
    class it builds its ServerArgs with, not by an __init__ hook, which would land too late."""
    assert outcome(entries, "first engine") == {"error": "--oea-min-batch must be an integer from 1 to 65536, got 0"}


def test_spawned_scheduler_process_sees_the_flags(moe_model):
    hooks.install()
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", moe_model, "--oea-k0", "3", "--oea-min-batch", "2", "--oea-max-batch", "64"])
    want = OEAConfig(k0=3, min_batch=2, max_batch=64).as_dict()
    assert server_args._oea == want
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=flags_probe.report_scheduler_config, args=(queue, server_args))
    child.start()
    got = queue.get(timeout=240)
    child.join(timeout=60)
    assert got == {"oea": want, "published": want, "missing": []}


def test_plugin_installed_but_off_wraps_no_routing_target(entries):
    result = outcome(entries, "role launcher without OEA")
    assert result["routing_missing"] == list(hooks.ROUTING_TARGETS), "no routing target is wrapped when OEA is off"
    assert result["cli_missing"] == [], "the flags are still available"


# Each process that loads plugins, run from its SGLang entry up to its first statement after
# load_plugins(): the hooks it has then. The launcher here with a config already published, as in a
# second Engine.
@pytest.mark.parametrize("role", ROLES)
def test_only_scheduler_processes_get_the_routing_hooks(entries, role):
    result = outcome(entries, f"role {role}")
    assert result["routing_missing"] == ([] if role == "scheduler" else list(hooks.ROUTING_TARGETS))
    assert result["control_missing"] == ([] if role == "scheduler" else list(hooks.CONTROL_TARGETS))
    assert result["cli_missing"] == [], "the flags' hooks are in every process"


def test_scheduler_without_oea_only_refuses_the_live_settings(entries):
    """OEA not installed: no routing target is wrapped in a scheduler either; its internal-state
    controller gets the one hook that refuses the oea_* keys with advice."""
    result = outcome(entries, "role scheduler without OEA")
    assert result["routing_missing"] == list(hooks.ROUTING_TARGETS)
    assert result["control_missing"] == [hooks.SET_STATE, hooks.GET_STATE]


def test_a_hook_target_gone_from_sglang_is_reported_missing():
    gone = ("sglang.srt.no_such_module.function", "sglang.srt.server_args.ServerArgs.no_such_method")
    assert hooks.missing_hooks(gone) == list(gone)
