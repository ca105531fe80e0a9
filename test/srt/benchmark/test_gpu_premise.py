"""benchmark/oea/gpu/moe_premise.py (OEA's premise on one GPU) and check 4's tile choice in
gpu_moe.py, on the CPU: the id synthesis (exactly T experts, K distinct per row), the OEA arm's
routing, the fit, the per-row-count verdicts and the go/no-go exit codes on made-up timings, the
argument checks, the dry run end to end in a child process (judged at the --rows given), and the
shared-memory arithmetic that picks check 4's tile configs per architecture."""

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from gpu import moe_premise, premise_calls
from gpu.gpu_moe import GEMM_CONFIGS, SMEM_WITHOUT_OPTIN, fitting_configs, smem_limit, tile_smem_bytes
from gpu.premise_report import (EXIT_DRY_RUN, EXIT_ERROR, EXIT_GO, EXIT_NO_GO, FAIL, NOT_JUDGED, OEA, PASS,
                                SYNTHETIC, TOPK, Point, fit_all, judge, predict)
from sglang_oea.reference import distinct_experts, opportunistic_route

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "benchmark", "oea", "gpu", "moe_premise.py")


@pytest.mark.parametrize("rows,top_k,experts", [(16, 8, 256), (5, 3, 11), (3, 4, 64), (7, 6, 20)])
def test_synthetic_ids_touch_exactly_T_experts_with_distinct_ids_per_row(rows, top_k, experts):
    gen = torch.Generator().manual_seed(rows)
    for T in range(top_k, min(rows * top_k, experts) + 1):
        ids = moe_premise.distinct_ids(rows, top_k, experts, T, gen)
        assert ids.shape == (rows, top_k) and ids.dtype == torch.int32
        assert 0 <= int(ids.min()) and int(ids.max()) < experts
        assert len(set(ids.flatten().tolist())) == T, T
        assert all(len(set(row)) == top_k for row in ids.tolist()), T


def test_synthetic_ids_refuse_a_T_no_batch_can_have():
    gen = torch.Generator().manual_seed(0)
    for T in (7, 33):  # below top-k; above rows x top-k
        with pytest.raises(ValueError, match="outside"):
            moe_premise.distinct_ids(4, 8, 256, T, gen)


def test_t_grid_spans_top_k_to_the_most_a_batch_can_touch():
    assert moe_premise.t_grid(16, 8, 256, 12)[0] == 8 and moe_premise.t_grid(16, 8, 256, 12)[-1] == 128
    assert moe_premise.t_grid(64, 8, 256, 12)[-1] == 256
    assert moe_premise.t_grid(1, 8, 256, 12) == [8]  # one row touches exactly top-k


def timed(rows, law, routes):
    """Points whose time follows law(T): a synthetic grid, and per draw a top-k and OEA batches."""
    points = [Point(rows, SYNTHETIC, None, 0, T, law(T), law(T) - 1, law(T) + 1, "cpu")
              for T in range(8, 129, 10)]
    for draw, (topk_T, oea) in enumerate(routes):
        points.append(Point(rows, TOPK, None, draw, topk_T, law(topk_T), 0, 0, "cpu"))
        points += [Point(rows, OEA, k0, draw, T, law(T), 0, 0, "cpu") for k0, T in oea.items()]
    return points


ROUTES = [(82, {3: 40, 5: 60}), (84, {3: 42, 5: 62})]


def test_fit_and_verdict_when_time_falls_with_T():
    wiggle = lambda T: 0.5 * ((T // 10) % 3 - 1)  # noqa: E731  deterministic noise
    points = timed(16, lambda T: 20 + 2.5 * T + wiggle(T), ROUTES) + timed(32, lambda T: 30 + 2 * T, ROUTES)
    points.append(Point(1, SYNTHETIC, None, 0, 8, 30.0, 29.0, 31.0, "cpu"))  # one row: T is always top-k
    fits = fit_all(points)
    assert fits[16].slope == pytest.approx(2.5, abs=0.05) and fits[16].intercept == pytest.approx(20, abs=3)
    assert 0 < fits[16].slope_low < fits[16].slope and fits[16].r2 > 0.99
    preds = {(p.rows, p.k0): p for p in predict(points, fits)}
    head = preds[(16, 5)]
    assert (head.topk_T, head.oea_T) == (83, 61)
    assert head.predicted == pytest.approx(fits[16].at(61) / fits[16].at(83))
    assert head.measured_lo <= head.measured <= head.measured_hi < 1
    got = judge(fits, list(preds.values()), [1, 16, 32], dry_run=False)
    assert [(v.rows, v.status) for v in got.per_rows] == [(1, NOT_JUDGED), (16, PASS), (32, PASS)]
    at16 = got.per_rows[1]
    assert at16.caveats == [] and (at16.k0, at16.predicted) == (5, head.predicted)
    assert at16.line.startswith("at 16 rows: pass: time falls with T; OEA k0=5")
    assert f"about {head.predicted:.2f}" in at16.line
    assert (got.go, got.passing, got.exit_code) == (True, [16, 32], EXIT_GO)
    assert got.line.startswith("GO: OEA is predicted to save >= 5% of the MoE layer at 16, 32 of 1, 16, 32 rows judged")
    assert "--oea-max-batch 32" in got.line and got.line.endswith("(exit 0)")


def test_verdict_when_time_is_flat_or_the_saving_too_small():
    flat = timed(16, lambda T: 100 + 0.2 * ((T // 10) % 3 - 1), ROUTES)
    got = judge(fit_all(flat), predict(flat, fit_all(flat)), [16], dry_run=False)
    assert got.per_rows[0].status == FAIL and "lower bound" in got.per_rows[0].line
    assert (got.go, got.exit_code) == (False, EXIT_NO_GO) and got.line.startswith("NO-GO: ")
    shallow = timed(16, lambda T: 1000 + 0.5 * T, ROUTES)  # rises, but k0=5 saves ~1%
    got = judge(fit_all(shallow), predict(shallow, fit_all(shallow)), [16], dry_run=False)
    assert got.exit_code == EXIT_NO_GO and "k0=5 would save 1%" in got.per_rows[0].line
    assert "under 5%" in got.per_rows[0].line


def test_each_judged_row_count_gets_its_verdict_and_the_largest_passing_is_the_cap():
    """EAGLE, 4 draft tokens: 64 and 128 rows gain, 192 rows only 2%, 256 rows not timed."""
    points = (timed(64, lambda T: 20 + 2.5 * T, ROUTES) + timed(128, lambda T: 30 + 2 * T, ROUTES)
              + timed(192, lambda T: 2000 + 2 * T, ROUTES))
    fits = fit_all(points)
    got = judge(fits, predict(points, fits), [64, 128, 192, 256], dry_run=False)
    assert [(v.rows, v.status) for v in got.per_rows] == [(64, PASS), (128, PASS), (192, FAIL), (256, NOT_JUDGED)]
    assert "out of --budget-s" in got.per_rows[3].line
    assert (got.go, got.passing, got.exit_code) == (True, [64, 128], EXIT_GO)
    assert "at 64, 128 of 64, 128, 192, 256 rows judged; fails at 192; not judged: 256" in got.line
    assert "Largest passing: 128 rows: --oea-max-batch 128 (exit 0)" in got.line
    gap = timed(64, lambda T: 1000 + 0.5 * T, ROUTES) + timed(128, lambda T: 30 + 2 * T, ROUTES)
    got = judge(fit_all(gap), predict(gap, fit_all(gap)), [128, 64], dry_run=False)
    assert got.passing == [128] and "--oea-max-batch 128 (it fails at 64, below that) (exit 0)" in got.line


def test_only_the_judged_row_counts_decide():
    """A row count swept but not judged (here the smaller, which the verdict once used) counts for nothing."""
    points = timed(16, lambda T: 20 + 2.5 * T, ROUTES) + timed(64, lambda T: 1000 + 0.5 * T, ROUTES)
    fits = fit_all(points)
    got = judge(fits, predict(points, fits), [64], dry_run=False)
    assert [(v.rows, v.status) for v in got.per_rows] == [(64, FAIL)] and got.exit_code == EXIT_NO_GO
    assert judge(fits, predict(points, fits), [16, 64], dry_run=False).exit_code == EXIT_GO


def test_a_dry_run_never_says_go_and_no_timing_is_no_verdict():
    points = timed(16, lambda T: 20 + 2.5 * T, ROUTES)
    got = judge(fit_all(points), predict(points, fit_all(points)), [16], dry_run=True)
    assert got.per_rows[0].status == PASS and got.go is None and got.exit_code == EXIT_DRY_RUN == 4
    assert all(line.startswith("DRY RUN (CPU stand-in, not a GPU result): ") for line in
               [got.line] + [v.line for v in got.per_rows])
    assert "GO:" not in got.line and got.line.endswith("(exit 4)")
    for dry_run in (False, True):
        none = judge({}, [], [16, 32], dry_run=dry_run)
        assert (none.go, none.exit_code) == (None, EXIT_ERROR) and none.line.startswith("NO VERDICT: ")
    assert len({EXIT_GO, EXIT_NO_GO, EXIT_DRY_RUN, EXIT_ERROR, 1}) == 5  # 1: Python's code for a crash


def test_a_step_in_time_is_flagged_as_not_linear():
    step = timed(16, lambda T: 50.0 if T < 60 else 150.0, ROUTES)
    fits = fit_all(step)
    caveats = judge(fits, predict(step, fits), [16], dry_run=False).per_rows[0].caveats
    assert fits[16].r2 < 0.9 and any("not linear" in c for c in caveats)


def test_the_oea_arm_routes_at_each_k0_below_top_k():
    """routed_batches' OEA ids are the reference OEA at each k0 on the same scores as its top-k arm."""
    shape = premise_calls.load_shape("tiny", None)[0]
    gen = torch.Generator().manual_seed(3)
    replay = torch.Generator().set_state(gen.get_state())
    got = list(moe_premise.routed_batches(6, shape, [3, 6], 2, gen))
    assert [(kind, k0, draw) for kind, k0, draw, _, _ in got] == [(TOPK, None, 0), (OEA, 3, 0), (OEA, 6, 0),
                                                                 (TOPK, None, 1), (OEA, 3, 1), (OEA, 6, 1)]
    for draw in range(2):
        scores = torch.rand(6, shape.experts, generator=replay)
        top_w, top_ids = scores.topk(shape.top_k, dim=1)
        _, _, _, ids, _ = got[3 * draw]
        assert torch.equal(ids, top_ids.to(torch.int32))
        top_T = int(distinct_experts(ids, shape.experts))
        for column, k0 in ((1, 3), (2, 6)):
            _, _, _, ids, weights = got[3 * draw + column]
            want, want_w = opportunistic_route(scores, scores, top_ids, top_w / top_w.sum(1, keepdim=True), k0)
            assert torch.equal(ids, want.to(torch.int32)) and torch.allclose(weights, want_w.float())
            assert int(distinct_experts(ids, shape.experts)) < top_T, (draw, k0)


def refusal(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        moe_premise.parse_args(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--backend", "flashinfer_cutlass", "--dtype", "bf16"], r"--backend flashinfer_cutlass with --dtype bf16 is not "
                                                             r"supported; supported: --backend flashinfer_cutlass"),
    (["--k0", "3", "8"], r"--k0 \[8\]: each must be in \[1, 7\]"),
    (["--model-config", "no-such-model"], r"--model-config 'no-such-model': neither a preset"),
    (["--model-config", "glm5-nvfp4", "--tp", "3"], r"--tp 3: must be >= 1 and divide the expert FFN width 2048"),
    (["--model-config", "glm5-nvfp4", "--tp", "256"], r"--dtype nvfp4 needs .*expert width per rank \(8, .*a multiple of 64"),
    (["--rows", "1", "64"], r"--rows \[1, 64\]: each must be in \[2, 65536\] \(one row always touches"),
    (["--rows", "65537"], r"--rows \[65537\]: each must be in \[2, 65536\]"),
    (["--rows"], r"--rows: expected at least one argument"),
    (["--points", "2"], r"--points 2: must be >= 3"),
])
def test_bad_arguments_are_refused_naming_the_flag(capsys, argv, message):
    assert re.search(message, refusal(capsys, ["--dry-run"] + argv))


def test_rows_are_the_row_counts_judged_and_the_default_sweep_stays_without_them():
    assert moe_premise.parse_args(["--dry-run", "--rows", "256", "64", "64", "128"])[0].rows == [64, 128, 256]
    assert moe_premise.parse_args(["--dry-run"])[0].rows == list(moe_premise.DRY_RUN_ROWS) == [4, 8]
    assert moe_premise.DEFAULT_ROWS == (16, 32, 64)


def test_an_error_during_the_run_exits_2_not_no_go(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("stand-in failed to build")

    monkeypatch.setattr(premise_calls, "TorchStandIn", broken)
    assert moe_premise.main(["--dry-run", "--out", str(tmp_path)]) == EXIT_ERROR
    out = capsys.readouterr()
    assert "stand-in failed to build" in out.err
    assert out.out.strip().splitlines()[-1] == "ERROR: the premise check did not finish: no verdict (exit 2)"


def test_nothing_timed_within_the_budget_is_no_verdict(tmp_path, capsys):
    assert moe_premise.main(["--dry-run", "--budget-s", "0", "--out", str(tmp_path)]) == EXIT_ERROR
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("NO VERDICT: no row count could be judged (of 4, 8 rows judged; not judged: 4, 8)")
    assert json.loads((tmp_path / "moe_premise.json").read_text())["verdict"]["exit_code"] == EXIT_ERROR


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_mode_without_cuda_is_refused(capsys):
    assert "no CUDA device (use --dry-run" in refusal(capsys, [])


def test_backend_dtype_and_arch_combinations():
    premise_calls.check_supported("flashinfer_cutlass", "nvfp4", (12, 0))
    premise_calls.check_supported("flashinfer_cutlass", "nvfp4", (10, 0))
    premise_calls.check_supported("triton", "fp8", (9, 0))
    for backend, dtype, cap, arch in [("triton", "bf16", (12, 0), "sm_120"), ("flashinfer_cutlass", "nvfp4", (9, 0),
                                                                             "sm_90")]:
        with pytest.raises(ValueError, match=f"--backend {backend} --dtype {dtype} runs on .*not on this {arch} GPU"):
            premise_calls.check_supported(backend, dtype, cap)


def test_shape_from_a_model_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="glm_moe_dsa", hidden_size=6144, n_routed_experts=256, moe_intermediate_size=2048,
        num_experts_per_tok=8, intermediate_size=12288)))
    shape, dtype = premise_calls.load_shape(str(tmp_path), 8)
    assert (shape.experts, shape.hidden, shape.inter, shape.top_k, shape.tp) == (256, 6144, 256, 8, 8)
    assert shape.name == "glm_moe_dsa" and dtype is None  # the dtype then comes from --dtype or the GPU
    preset = premise_calls.load_shape("glm5-nvfp4", None)[0]
    assert (preset.experts, preset.hidden, preset.inter, preset.top_k) == (256, 6144, 256, 8)


def test_docs_cite_the_calls_the_installed_sglang_makes():
    """docs/gpu.md names each timed call with file and line; they must be where the wheel has them."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed")
    docs = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    for backend in ("flashinfer_cutlass", "triton"):
        site = premise_calls.call_site(backend)
        assert site is not None, backend
        assert f"`{site.split('/moe/')[1]}`" in docs, site


def round_up(n, m):
    return (n + m - 1) // m * m


def test_gpu_calls_bind_to_the_installed_functions_with_the_layouts_they_check():
    """The GPU mode's arguments, built on the CPU: every keyword exists in the installed function,
    and the NVFP4 weights and scales have the shapes flashinfer's binding checks
    (flashinfer_cutlass_fused_moe_binding.cu, getQuantParams: block-scale rows 2 x align(I, 64) and
    align(H, 128), columns align(K, 64) / 64 as int32), the fp8 scales those SGLang's Triton launcher
    asserts (cdiv(N, 128), cdiv(K, 128))."""
    if importlib.util.find_spec("flashinfer") is None or importlib.util.find_spec("sglang") is None:
        pytest.skip("flashinfer and SGLang are not installed")
    E, H, inter, K, rows = 4, 256, 128, 2, 5
    shape = premise_calls.PremiseShape("t", E, H, inter, K, 8)
    gen = torch.Generator().manual_seed(0)
    ids, weights = moe_premise.distinct_ids(rows, K, E, 3, gen), moe_premise.row_weights(rows, K, gen)

    nvfp4 = premise_calls.CutlassNvfp4(shape, gen, max_rows=24, autotune=False, device="cpu")
    nvfp4.prepare(rows)
    kwargs = nvfp4.call_kwargs(ids, weights)
    inspect.signature(nvfp4.fn).bind(**kwargs)
    assert kwargs["fc1_expert_weights"].shape == (E, 2 * inter, H // 16) and kwargs["tune_max_num_tokens"] == 32
    assert kwargs["fc2_expert_weights"].shape == (E, H, inter // 16)  # int64: 16 e2m1 values each
    assert kwargs["fc1_expert_weights"].dtype == torch.int64 and kwargs["input"].shape == (rows, H)
    act1, block1, alpha1, act2, block2, alpha2 = kwargs["quant_scales"]
    assert act1.dim() == act2.dim() == 0 and alpha1.shape == alpha2.shape == (E,)
    assert block1.dtype == block2.dtype == torch.int32
    assert block1.shape == (E, 2 * round_up(inter, 64), round_up(H, 64) // 64)
    assert block2.shape == (E, round_up(H, 128), round_up(inter, 64) // 64)
    assert kwargs["token_selected_experts"].dtype == torch.int32 and kwargs["tp_size"] == 8

    for dtype in ("bf16", "fp8"):
        triton_moe = premise_calls.TritonFusedMoE(shape, dtype, gen, device="cpu")
        triton_moe.prepare(rows)
        args, kwargs = triton_moe.call_args(ids, weights)
        inspect.signature(triton_moe.fn).bind(*args, **kwargs)
        assert args[4].inplace and args[1].shape == (E, 2 * inter, H) and args[2].shape == (E, H, inter)
        if dtype == "fp8":
            assert args[1].dtype == torch.float8_e4m3fn and kwargs["block_shape"] == [128, 128]
            assert kwargs["w1_scale"].shape == (E, -(-2 * inter // 128), -(-H // 128))
            assert kwargs["w2_scale"].shape == (E, -(-H // 128), -(-inter // 128))


def test_dry_run_end_to_end_judges_at_the_rows_given(tmp_path):
    out = tmp_path / "premise"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--points", "4", "--draws", "2", "--replays", "3", "--rows", "12", "5",
         "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == EXIT_DRY_RUN, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "moe_premise.json").read_text())
    assert record["meta"]["dry_run"] and record["meta"]["rows"] == record["meta"]["judged_rows"] == [5, 12]
    judged = record["verdict"]
    assert [v["rows"] for v in judged["per_rows"]] == [5, 12] and judged["exit_code"] == EXIT_DRY_RUN
    assert judged["go"] is None and judged["line"].startswith("DRY RUN (CPU stand-in, not a GPU result): no go/no-go")
    assert all(v["line"].startswith(f"DRY RUN (CPU stand-in, not a GPU result): at {v['rows']} rows: ")
               and v["status"] in (PASS, FAIL) for v in judged["per_rows"])
    assert done.stdout.strip().splitlines()[-1] == judged["line"]  # the go/no-go line comes last
    shape = premise_calls.load_shape("tiny", None)[0]
    for rows in (5, 12):
        mine = [p for p in record["points"] if p["rows"] == rows]
        synthetic = sorted(p["T"] for p in mine if p["kind"] == SYNTHETIC)
        assert synthetic == moe_premise.t_grid(rows, shape.top_k, shape.experts, 4)
        for draw in (0, 1):
            top = next(p["T"] for p in mine if p["kind"] == TOPK and p["draw"] == draw)
            oea = {p["k0"]: p["T"] for p in mine if p["kind"] == OEA and p["draw"] == draw}
            # below top-k's T at every k0: an OEA arm routed at k0 = top-k would touch as many
            assert sorted(oea) == [3, 4, 5, 6] and all(shape.top_k <= T < top for T in oea.values()), (rows, oea)
        assert all(p["mode"] == "cpu" and p["median_us"] > 0 for p in mine)
    assert {f["rows"] for f in record["fits"]} == {5, 12}
    md = (out / "moe_premise.md").read_text()
    assert "**DRY RUN on the CPU" in md and "## Verdict" in md and "Thresholds:" in md
    assert f"**{judged['line']}**" in md and all(f"- {v['line']}" in md for v in judged["per_rows"])
    pytest.importorskip("matplotlib")
    assert (out / "moe_premise.png").read_bytes()[:4] == b"\x89PNG"


def test_check_4_tile_configs_fit_the_shared_memory_of_each_arch():
    assert tile_smem_bytes(GEMM_CONFIGS[3], 2) == 110592  # 16x128x128, 3 stages, bf16
    sm120, source = smem_limit((12, 0), None)
    assert sm120 == 101376 and "sm_120" in source
    fit, left_out = fitting_configs(GEMM_CONFIGS, sm120, 2)
    assert left_out == [(GEMM_CONFIGS[3], 110592)] and fit == list(GEMM_CONFIGS[:3])
    assert fitting_configs(GEMM_CONFIGS, smem_limit((9, 0), None)[0], 2) == (list(GEMM_CONFIGS), [])
    assert smem_limit((12, 0), 99000) == (99000, "shared_memory_per_block_optin reported by torch")
    assert smem_limit((7, 5), None)[0] == SMEM_WITHOUT_OPTIN
    fit, left_out = fitting_configs(GEMM_CONFIGS, SMEM_WITHOUT_OPTIN, 2)
    assert fit == [GEMM_CONFIGS[2]] and len(left_out) == 3  # only 16x64x64, 3 stages: 30720 B
    tiny_limit = 12000  # none fits: the smallest, with fewer stages
    fit, _ = fitting_configs(GEMM_CONFIGS, tiny_limit, 2)
    assert len(fit) == 1 and fit[0]["num_stages"] == 1 and tile_smem_bytes(fit[0], 2) <= tiny_limit
    assert GEMM_CONFIGS[2]["num_stages"] == 3  # the table itself is left alone
