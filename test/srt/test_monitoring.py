"""The monitoring files an operator loads (monitoring/): the Prometheus rules, loaded by the real
`promtool check rules` and evaluated by `promtool test rules`, and the Grafana dashboard, whose
every query names series the server exports and returns data on a server's series.

Input series take their names and label sets from the recorded /metrics scrapes of the real
server (benchmark/oea/results/cpu-2026-12-03-metrics-scrapes and -kept-mass-scrapes), plus job and
instance, which Prometheus adds when it scrapes; the values are each scenario's. The kept-mass
scrapes were saved with model_name removed: it is put back. Two series are in no recorded scrape
(the scrapes kept only the sglang:oea_* and sglang:spec_* lines): SGLang's tokenizer counters
sglang:generation_tokens_total and sglang:spec_verify_calls_total, whose names are checked against
SGLang's own metrics_collector.py and whose labels follow its tokenizer_metric_labels().

promtool is Debian's `prometheus` package (.ci/run installs it). Without it these tests fail under
CI=true and skip elsewhere, naming the install command.
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES, TARGETS = MONITORING / "sglang-oea-rules.yml", MONITORING / "sglang-oea-targets.yml"
DASHBOARD = MONITORING / "sglang-oea-dashboard.json"
RESULTS = ROOT / "benchmark" / "oea" / "results"
QWEN, GLM = "/work/main/benchmark/oea/models/qwen3_moe_stdlib", "/work/main/benchmark/oea/models/glm4_moe_stdlib"
# Recorded scrape -> the model_name to put back where the file was saved without it.
SCRAPES = {
    RESULTS / "cpu-2026-12-03-metrics-scrapes" / "armed-then-k0-4.metrics.txt": None,
    RESULTS / "cpu-2026-12-03-metrics-scrapes" / "ngram-k0-4.metrics.txt": None,
    RESULTS / "cpu-2026-12-03-kept-mass-scrapes" / "qwen3_moe_stdlib.metrics.txt": QWEN,
    RESULTS / "cpu-2026-12-03-kept-mass-scrapes" / "glm4_moe_stdlib.metrics.txt": GLM,
}
INSTALL = "apt-get update && apt-get install -y prometheus"
A, B, C = "oea-a:30000", "oea-b:30000", "oea-c:30000"  # instances, as Prometheus labels its targets

APPLIED, SKIPPED = "sglang:oea_decode_steps_applied_total", "sglang:oea_decode_steps_skipped_total"
LOST, TOKENS = "sglang:oea_router_mass_lost_total", "sglang:oea_routed_token_layers_total"
K0 = "sglang:oea_k0"
SHARE, KEPT = "instance:sglang_oea_applied_share:rate10m", "instance:sglang_oea_kept_router_mass:rate10m"


@pytest.fixture(scope="module")
def promtool():
    path = shutil.which("promtool")
    if path is None:
        message = f"promtool not found; it comes with Debian's prometheus package: {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message} (.ci/run installs it before `make test`)")
        pytest.skip(message)
    return path


# ----------------------------------------------------------------------------- the recorded scrapes


def read_scrape(path: pathlib.Path, model_name=None):
    """[(name, labels)] of the sample lines of one recorded /metrics scrape."""
    series = []
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? \S+$", line)
        if match:
            labels = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
            if model_name is not None:
                labels.setdefault("model_name", model_name)
            series.append((match.group(1), labels))
    return series


RECORDED = {path: read_scrape(path, model) for path, model in SCRAPES.items()}


def recorded(name, **match):
    """The labels of the first recorded series `name` whose labels include `match`."""
    for series in RECORDED.values():
        for found, labels in series:
            if found == name and all(labels.get(k) == v for k, v in match.items()):
                return dict(labels)
    raise AssertionError(f"no recorded scrape has {name} with {match}")


def braces(labels):
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def series(name, values, instance, relabel=None, **match):
    """A promtool input series: a recorded series' labels (relabel: values no recorded scrape
    has, such as a rare skip reason), job and instance added."""
    labels = dict(recorded(name, **match), **(relabel or {}), job="sglang", instance=instance)
    return {"series": name + braces(labels), "values": values}


def tokenizer_series(name, values, instance, model_name):
    """SGLang's tokenizer-side counters: labels from its tokenizer_metric_labels() (model_name,
    engine_type) and is_streaming on generation_tokens_total; no tp_rank."""
    labels = {"model_name": model_name, "engine_type": "unified", "job": "sglang", "instance": instance}
    if name == "sglang:generation_tokens_total":
        labels["is_streaming"] = "false"
    return {"series": name + braces(labels), "values": values}


def armed_server(instance, model, k0, applied, skipped, lost, tokens):
    """The series of one armed server decoding at one k0 for 90 minutes, shaped as its scrape: its
    decode steps skip with oea_off at k0 0, else below the gate."""
    reason = "oea_off" if k0 == "0" else "below_min_batch"
    return [
        series(K0, f"{k0}x90", instance, model_name=model),
        series(APPLIED, applied, instance, model_name=model, k0=k0, mode="decode"),
        series(SKIPPED, skipped, instance, model_name=model, k0=k0, mode="decode", reason=reason),
        series(SKIPPED, "0+5x90", instance, model_name=model, k0=k0, mode="other", reason="not_decode"),
        series(LOST, lost, instance, model_name=model, k0=k0),
        series(TOKENS, tokens, instance, model_name=model, k0=k0),
    ]


# ----------------------------------------------------------------------------- running promtool


def targets(tmp_path, **models):
    """An operator's targets file: the shipped one's two entries, once per model (name -> (k0, floor);
    None leaves that entry out)."""
    template = yaml.safe_load(TARGETS.read_text())
    rules = template["groups"][0]["rules"]
    assert [r["record"] for r in rules] == ["sglang_oea:intended_k0", "sglang_oea:kept_router_mass_floor"]
    entries = []
    for model, values in models.items():
        for rule, value in zip(rules, values):
            if value is not None:
                entries.append(dict(rule, expr=f"vector({value})", labels={"model_name": model}))
    path = tmp_path / "targets.yml"
    path.write_text(yaml.safe_dump({"groups": [dict(template["groups"][0], rules=entries)]}))
    return path


def promtool_test(promtool, tmp_path, input_series, checks, rule_files):
    """Run `promtool test rules` on one scenario (1-minute samples and evaluations); fail with its output."""
    spec = {"rule_files": [str(p) for p in rule_files], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": input_series, "promql_expr_test": checks}]}
    path = tmp_path / "scenario.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool test rules failed:\n{done.stdout}\n{done.stderr}"


def firing(eval_time, *alerts):
    """The alerts firing at eval_time are exactly `alerts`: (alertname, instance, model_name)."""
    return {"expr": 'count by (alertname, instance, model_name) (ALERTS{alertstate="firing"})', "eval_time": eval_time,
            "exp_samples": [{"labels": braces(dict(alertname=n, instance=i, model_name=m)), "value": 1}
                            for n, i, m in alerts]}


def recorded_value(record, eval_time, value, **labels):
    """A recorded series' value at eval_time, to 0.001."""
    return {"expr": f"round({record}{braces(labels)}, 0.001)", "eval_time": eval_time,
            "exp_samples": [{"labels": braces(dict(labels, job="sglang")), "value": value}]}


# ----------------------------------------------------------------------------- the rules


def test_promtool_loads_the_rules_and_the_targets(promtool):
    done = subprocess.run([promtool, "check", "rules", str(RULES), str(TARGETS)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 11 rules found" in done.stdout and "SUCCESS: 2 rules found" in done.stdout, done.stdout


def test_a_healthy_server_fires_nothing_and_records_its_shares(promtool, tmp_path):
    """k0 as intended, kept mass above the floor, OEA routing 3 decode steps in 4: nothing fires,
    and the shares are recorded as defined."""
    inputs = armed_server(A, QWEN, "4", applied="0+9x90", skipped="0+3x90", lost="0+8x90", tokens="0+64x90")
    checks = [
        firing("60m"),
        # 9 applied / (9 + 3 skipped) decode steps; prefill passes (mode="other") left out.
        recorded_value(SHARE, "60m", 0.75, instance=A, model_name=QWEN, tp_rank="0"),
        recorded_value(KEPT, "60m", 0.875, instance=A, model_name=QWEN, tp_rank="0"),
    ]
    promtool_test(promtool, tmp_path, inputs, checks, [RULES, targets(tmp_path, **{QWEN: (4, 0.70)})])


def test_a_model_without_both_targets_is_named(promtool, tmp_path):
    """A's model has no floor, B's no intended k0, C's (served as GLM-5) neither: each is named."""
    inputs = armed_server(A, QWEN, "4", applied="0+9x90", skipped="0+3x90", lost="0+8x90", tokens="0+64x90")
    inputs += armed_server(B, GLM, "4", applied="0+9x90", skipped="0+3x90", lost="0+8x90", tokens="0+64x90")
    inputs.append(series(K0, "4x90", C, relabel={"model_name": "GLM-5"}, model_name=QWEN))
    missing = [("OEATargetsMissing", i, m) for i, m in ((A, QWEN), (B, GLM), (C, "GLM-5"))]
    checks = [firing("20m"), firing("40m", *missing)]
    promtool_test(promtool, tmp_path, inputs, checks, [RULES, targets(tmp_path, **{QWEN: (4, None), GLM: (None, 0.7)})])


def test_a_k0_left_behind_by_a_trial_fires_and_so_does_its_kept_mass(promtool, tmp_path):
    """k0 4 (intended) until minute 30, then 1, as a trial that never restored would leave it; its
    steps keep 1 - 35/64 of the router's mass, below the floor of 0.70. Both alerts wait 15 minutes."""
    inputs = [
        series(K0, "4x30 1x60", A, model_name=QWEN),
        series(APPLIED, "0+9x30 270x60", A, model_name=QWEN, k0="4", mode="decode"),
        series(APPLIED, "_x31 0+9x59", A, model_name=QWEN, k0="1", mode="decode"),
        series(LOST, "0+8x30 240x60", A, model_name=QWEN, k0="4"),
        series(TOKENS, "0+64x30 1920x60", A, model_name=QWEN, k0="4"),
        series(LOST, "_x31 0+35x59", A, model_name=QWEN, k0="1"),
        series(TOKENS, "_x31 0+64x59", A, model_name=QWEN, k0="1"),
    ]
    checks = [firing("30m"), firing("40m"),
              firing("60m", ("OEAK0NotIntended", A, QWEN), ("OEAKeptRouterMassLow", A, QWEN)),
              recorded_value(KEPT, "60m", 0.453, instance=A, model_name=QWEN, tp_rank="0")]
    promtool_test(promtool, tmp_path, inputs, checks, [RULES, targets(tmp_path, **{QWEN: (4, 0.70)})])


def test_armed_on_with_nothing_applied_fires_and_armed_off_does_not(promtool, tmp_path):
    """A: k0 4, every decode step below the gate. B: armed off (k0 0, intended 0): its steps skip
    with oea_off, as they should."""
    inputs = armed_server(A, QWEN, "4", applied="0x90", skipped="0+12x90", lost="0x90", tokens="0+64x90")
    inputs += armed_server(B, GLM, "0", applied="0x90", skipped="0+12x90", lost="0x90", tokens="0+64x90")
    checks = [firing("60m", ("OEAArmedButNotApplying", A, QWEN)),
              recorded_value(SHARE, "60m", 0, instance=B, model_name=GLM, tp_rank="0")]
    promtool_test(promtool, tmp_path, inputs, checks, [RULES, targets(tmp_path, **{QWEN: (4, 0.70), GLM: (0, 0)})])


def test_accept_length_down_fires_only_where_it_fell_and_oea_routes_verify_passes(promtool, tmp_path):
    """Speculative servers, 100 verify passes a minute, 2.8 tokens per pass for 6 hours. Then A and
    B fall to 2.5 (more than 5% below), C to 2.7 (less); OEA routes A's and C's verify passes, none of B's."""
    before, fallen, slight = "0+280x359 100770+250x60", "0+280x359 100770+250x60", "0+280x359 100790+270x60"
    inputs = []
    for instance, tokens, applied in ((A, fallen, "0+9x420"), (B, before, "0x420"), (C, slight, "0+9x420")):
        inputs += [
            series(K0, "4x420", instance, model_name=QWEN),
            series(APPLIED, applied, instance, model_name=QWEN, k0="4", mode="verify"),
            series(SKIPPED, "0+3x420", instance, model_name=QWEN, k0="4", mode="verify", reason="below_min_batch"),
            tokenizer_series("sglang:generation_tokens_total", tokens, instance, QWEN),
            tokenizer_series("sglang:spec_verify_calls_total", "0+100x420", instance, QWEN),
        ]
    not_applying = ("OEAArmedButNotApplying", B, QWEN)  # B is on (k0 4) and routes nothing: it says so too
    checks = [firing("350m", not_applying), firing("410m", ("OEAAcceptLengthDown", A, QWEN), not_applying),
              recorded_value("instance:sglang_spec_accept_length:rate10m", "300m", 2.8, instance=A, model_name=QWEN),
              recorded_value("instance:sglang_spec_accept_length:rate10m", "410m", 2.5, instance=A, model_name=QWEN)]
    promtool_test(promtool, tmp_path, inputs, checks, [RULES, targets(tmp_path, **{QWEN: (4, 0.70)})])


def test_a_backend_oea_cannot_route_a_failed_self_check_and_no_saving_fire(promtool, tmp_path):
    """A skips with no_topk_ids; B's kernel self-check failed; C routes 90% of its steps and keeps
    97% of the experts. The reason and the failed result are set on recorded label sets."""
    inputs = [series(K0, "4x90", i, model_name=QWEN) for i in (A, B, C)] + [
        series(SKIPPED, "0+12x90", A, relabel={"reason": "no_topk_ids"}, model_name=QWEN, k0="4", mode="decode",
               reason="below_min_batch"),
        series("sglang:oea_kernel_info", "1x90", B, relabel={"kernel": "off", "self_check": "failed"},
               model_name=QWEN, kernel="torch"),
        series("sglang:oea_active_experts_ratio", "0.97x90", C, model_name=QWEN),
        series(APPLIED, "0+9x90", C, model_name=QWEN, k0="4", mode="decode"),
        series(SKIPPED, "0+1x90", C, model_name=QWEN, k0="4", mode="decode", reason="below_min_batch"),
    ]
    checks = [firing("20m", ("OEACannotRoute", A, QWEN), ("OEAKernelSelfCheckFailed", B, QWEN)),
              firing("60m", ("OEACannotRoute", A, QWEN), ("OEAKernelSelfCheckFailed", B, QWEN),
                     ("OEANotSavingExperts", C, QWEN))]
    promtool_test(promtool, tmp_path, inputs, checks, [RULES, targets(tmp_path, **{QWEN: (4, 0.70)})])


# ----------------------------------------------------------------------------- the dashboard


DASHBOARD_VARIABLES = {"$__rate_interval": "5m", "$model_name": ".*", "$instance": ".*"}


def dashboard_queries():
    """{where: PromQL} of every query in the dashboard: panel targets, annotations, and the metric
    of each template variable's label_values()."""
    board = json.loads(DASHBOARD.read_text())
    queries = {f"panel {p['title']!r} {t['refId']}": t["expr"] for p in board["panels"] for t in p["targets"]}
    queries.update({f"annotation {a['name']!r}": a["expr"] for a in board["annotations"]["list"] if "expr" in a})
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            metric = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"]).group(1)
            queries[f"variable {var['name']!r}"] = metric
    return queries


def with_variables(expr):
    for name, value in DASHBOARD_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def test_dashboard_shows_what_an_operator_watches():
    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    assert all(p["datasource"]["uid"] == "${datasource}" and p["targets"] and "gridPos" in p for p in panels)
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "model_name", "instance"]
    exprs = " ".join(dashboard_queries().values())
    for watched in ("sglang:oea_active_experts_before", "sglang:oea_active_experts_after", APPLIED, SKIPPED,
                    "sglang:oea_layer_kept_router_mass", K0, "sglang:spec_accept_length",
                    "sglang:generation_tokens_total", "sglang:spec_verify_calls_total"):
        assert watched in exprs, f"no dashboard query reads {watched}"


def dashboard_server(instance):
    """Every series the dashboard reads, for one speculative server (k0 4, verify passes)."""
    return [
        series(K0, "4x90", instance, model_name=QWEN),
        series("sglang:oea_min_batch", "2x90", instance, model_name=QWEN),
        series("sglang:oea_max_batch", "0x90", instance, model_name=QWEN),
        series(APPLIED, "0+9x90", instance, model_name=QWEN, k0="4", mode="verify"),
        series(SKIPPED, "0+3x90", instance, model_name=QWEN, k0="4", mode="verify", reason="below_min_batch"),
        series(SKIPPED, "0+5x90", instance, model_name=QWEN, k0="4", mode="other", reason="not_decode"),
        series(LOST, "0+8x90", instance, model_name=QWEN, k0="4"),
        series(TOKENS, "0+64x90", instance, model_name=QWEN, k0="4"),
        series("sglang:oea_active_experts_ratio", "0.55x90", instance, model_name=QWEN),
        series("sglang:spec_accept_length", "2.5x90", instance, model_name=QWEN),
        tokenizer_series("sglang:generation_tokens_total", "0+250x90", instance, QWEN),
        tokenizer_series("sglang:spec_verify_calls_total", "0+100x90", instance, QWEN),
    ] + [series(name, "20x90", instance, model_name=QWEN, layer=str(layer))
         for name in ("sglang:oea_active_experts_before", "sglang:oea_active_experts_after") for layer in range(4)] + [
        series("sglang:oea_layer_kept_router_mass", "0.78x90", instance, model_name=QWEN, k0="4", layer=str(layer))
        for layer in range(4)]


def test_every_dashboard_query_parses_and_returns_data(promtool, tmp_path):
    """With the dashboard's variables at All and one speculative server's series, each query
    (the k0-change annotation at a change) returns at least one series; a query that promtool
    cannot parse fails the run."""
    inputs = dashboard_server(A)
    inputs[0] = series(K0, "4x45 2x45", A, model_name=QWEN)  # a live change, for the annotation
    checks = [{"expr": f"clamp_max(count({with_variables(expr)}), 1)", "eval_time": "46m",
               "exp_samples": [{"labels": "{}", "value": 1}]} for expr in dashboard_queries().values()]
    promtool_test(promtool, tmp_path, inputs, checks, [])


def test_dashboard_shares_read_as_the_rules_define_them(promtool, tmp_path):
    """The panels that compute a share: 9 of 12 verify passes routed (prefill passes left out),
    1 - 8/64 of the router's mass kept, 250 tokens per 100 verify passes."""
    panels = {p["title"]: p["targets"][0]["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    expected = {"OEA applied share of decode and verify passes": 0.75,
                "Kept router mass, all layers (over the window)": 0.875, "Accept length (speculative decoding)": 2.5}
    checks = [{"expr": f"round({with_variables(panels[title])}, 0.001)", "eval_time": "60m",
               "exp_samples": [{"labels": braces({"instance": A} if "Accept" in title else
                                                 dict(instance=A, job="sglang", model_name=QWEN, tp_rank="0")),
                                "value": value}]}
              for title, value in expected.items()]
    promtool_test(promtool, tmp_path, dashboard_server(A), checks, [])


# ----------------------------------------------------------------------------- metric names


PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
                "bool", "inf", "nan"}


def metric_names(expr):
    """The metric names a PromQL expression selects (functions, keywords, labels and durations left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![A-Za-z0-9_:.$])[A-Za-z_:][A-Za-z0-9_:]*", text):
        if match.group(0).lower() not in PROMQL_WORDS and not re.match(r"\s*\(", text[match.end():]):
            names.add(match.group(0))
    return names


def selector_labels(expr):
    """(metric, label) for every label matcher written on a named selector."""
    for metric, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr):
        for label in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
            yield metric, label


def rules_queries():
    """({where: PromQL}, the names the rule files record) of the rules and the shipped targets."""
    queries, records = {}, set()
    for path in (RULES, TARGETS):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                where = rule.get("record") or rule["alert"]
                queries[f"{path.name} {where}"] = rule["expr"]
                records.update([rule["record"]] if "record" in rule else [])
    return queries, records


def plugin_series_names(monkeypatch):
    """The series names the current plugin exports (sglang_oea.metrics, in a registry of the test's own)."""
    import prometheus_client

    from sglang_oea import metrics
    from sglang_oea.config import LiveSettings

    registry = prometheus_client.CollectorRegistry()
    for kind in ("Counter", "Gauge"):
        cls = getattr(prometheus_client, kind)
        monkeypatch.setattr(prometheus_client, kind, lambda *a, _cls=cls, **kw: _cls(*a, registry=registry, **kw))
    metrics.PrometheusExport("m", 0, LiveSettings(4, 2, 0))
    return {f"{f.name}_total" if f.type == "counter" else f.name for f in registry.collect()}


def sglang_series_names():
    """The series names SGLang's own metrics_collector.py declares (read, not imported)."""
    package = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    source = (package / "srt" / "observability" / "metrics_collector.py").read_text()
    return set(re.findall(r'name="(sglang:[A-Za-z0-9_:]+)"', source))


def test_the_name_extraction_sees_selectors_and_nothing_else():
    expr = ('sum without (mode, k0) (rate(a:b_total{tp_rank="0", mode!="x"}[10m])) / (c:d > 0) '
            'and on (job) avg_over_time(e:f[6h] offset 10m) < 0.95 * vector(1)')
    assert metric_names(expr) == {"a:b_total", "c:d", "e:f"}
    assert set(selector_labels(expr)) == {("a:b_total", "tp_rank"), ("a:b_total", "mode")}


def test_every_metric_name_is_one_the_server_exports(monkeypatch):
    """Each series a rule or a dashboard query reads is in a recorded scrape of the real server, and
    each sglang:oea_* one is also exported by the plugin as it is now (a renamed series fails here
    even where an old scrape still has it). SGLang's own series that no recorded scrape kept are
    checked against the names its metrics_collector.py declares. Label matchers name labels the
    recorded series carry (or job and instance)."""
    rule_queries, records = rules_queries()
    queries = dict(rule_queries, **{k: with_variables(v) for k, v in dashboard_queries().items()})
    scraped = {}  # name -> every label any recorded scrape has on it
    for name, labels in (pair for scrape in RECORDED.values() for pair in scrape):
        scraped.setdefault(name, set()).update(labels)
    plugin, sglang = plugin_series_names(monkeypatch), sglang_series_names()
    unknown, not_scraped, bad_labels = [], set(), []
    for where, expr in queries.items():
        used = metric_names(expr) - records
        for name in used:
            if name.startswith("sglang:oea_") and name not in plugin:
                unknown.append(f"{where}: {name} (not exported by sglang_oea.metrics)")
            elif name not in scraped and (name.startswith("sglang:oea_") or name not in sglang):
                unknown.append(f"{where}: {name}")
            elif name not in scraped:
                not_scraped.add(name)
        bad_labels += [f"{where}: {m}{{{label}}}" for m, label in selector_labels(expr)
                       if m in scraped and label not in scraped[m] | {"job", "instance"}]
    assert not unknown, "series the server does not export:\n" + "\n".join(sorted(unknown))
    assert not bad_labels, "labels the series do not carry:\n" + "\n".join(sorted(bad_labels))
    # Only SGLang's tokenizer counters come from its source, not a recorded scrape.
    assert not_scraped == {"sglang:generation_tokens_total", "sglang:spec_verify_calls_total"}, not_scraped
