"""The quality A/B's report files: quality.md (one two-column table, then the definitions and
warnings), quality.json, outputs.jsonl (per prompt).
"""

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

from common.oea_metrics import APPLIED_DEFINITION
from serving.quality_inputs import Item
from serving.quality_scoring import (AGREEMENT_DEFINITION, DIVERGENCE_DEFINITION, REFERENCE_DEFINITION, build_report,
                                     extract_answer, first_divergence, reference_match)


def fmt(value, digits: int = 4) -> str:
    """A number for the table ('n/a' for None)."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.{digits}f}"
    return str(int(value)) if isinstance(value, float) else str(value)


def fmt_ci(ci) -> str:
    return "n/a" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def agreement_rows(label: str, section: Dict) -> List[Tuple[str, str]]:
    div = section["first_divergence"]
    hist = ", ".join(f"{h['bucket']}: {h['count']}" for h in div["histogram"]) or "none"
    spread = "/".join(fmt(div[k], 1) for k in ("min", "p25", "median", "p75", "max")) if div["count"] else "n/a"
    return [(f"{label}token agreement (positional)", f"{fmt(section['token_agreement'])} "
             f"({section['positions_agreeing']}/{section['positions_compared']} positions)"),
            (f"{label}identical outputs", f"{fmt(section['identical_share'])} ({section['identical']}/{section['n']})"),
            (f"{label}first divergence min/p25/median/p75/max", f"{spread} (over {div['count']} differing)"),
            (f"{label}first divergence histogram", hist)]


def accuracy_rows(acc: Optional[Dict]) -> List[Tuple[str, str]]:
    if acc is None:
        return [("accuracy", "n/a (no prompt has an answer)")]
    rows = [(f"accuracy {arm} (Wilson 95%)", f"{fmt(acc[arm]['accuracy'])} {fmt_ci(acc[arm]['ci95'])} "
             f"({acc[arm]['correct']}/{acc[arm]['n']})") for arm in ("baseline", "oea")]
    diff = acc["paired_difference"]
    counts = f"{diff['oea_only_correct']} / {diff['baseline_only_correct']}"
    mean = f"{fmt(diff['mean'])} {fmt_ci(diff['ci95'])}"
    return rows + [("accuracy OEA - baseline (paired, normal approx. 95%)", mean),
                   ("discordant pairs (OEA only / baseline only correct)",
                    f"{counts}, exact McNemar p = {fmt(diff['mcnemar_exact_p'])}")]


def reference_rows(ref: Optional[Dict]) -> List[Tuple[str, str]]:
    if ref is None:
        return []
    return [("reference match baseline / OEA (mean over prompts)", f"{fmt(ref['baseline'])} / {fmt(ref['oea'])} "
             f"({ref['n']} prompts)"),
            ("reference match OEA - baseline (paired, bootstrap 95%)", f"{fmt(ref['mean'])} {fmt_ci(ref['ci95'])}")]


def applied_rows(applied: Optional[Dict]) -> List[Tuple[str, str]]:
    if applied is None:
        return [("OEA applied (share of decode steps)", "n/a (no OEA counters on the OEA server's /metrics)")]
    return [("OEA applied (share of decode steps)", f"{fmt(applied['share'])} ({fmt(applied['applied_steps'])}/"
             f"{fmt(applied['decode_steps'])} steps, tp_rank {applied['tp_rank'] or 'unlabelled'})")]


def render_markdown(report: Dict) -> str:
    """quality.md: one two-column table, then the definitions and warnings."""
    sizes = f"{report['n_prompts']} / {report['concurrency']} / {report['max_tokens']}"
    rows = [("prompts / concurrency / max tokens", sizes)]
    rows += agreement_rows("", report["agreement"])
    if report["noise_floor"] is not None:
        rows += agreement_rows("noise floor (baseline vs baseline): ", report["noise_floor"])
    rows += accuracy_rows(report["accuracy"]) + reference_rows(report.get("reference_match"))
    rows += applied_rows(report["oea_applied"])
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    notes = [f"- token agreement: {AGREEMENT_DEFINITION}.", f"- first divergence: {DIVERGENCE_DEFINITION}."]
    notes += [f"- reference match: {REFERENCE_DEFINITION}."] if report.get("reference_match") else []
    notes += [f"- OEA applied: {APPLIED_DEFINITION}."] if report["oea_applied"] is not None else []
    notes += [f"- warning: {w}" for w in report["warnings"]]
    return "\n".join(lines + [""] + notes) + "\n"


def per_prompt_rows(items: Sequence[Item], base: Dict, oea: Dict) -> List[Dict]:
    """outputs.jsonl: each prompt's outputs, divergence, extracted answers and reference match."""
    rows = []
    for item, b, o in zip(items, base["outputs"], oea["outputs"]):
        row = {"prompt": item.prompt, "answer": item.answer, "baseline": b, "oea": o,
               "first_divergence": first_divergence(b["token_ids"], o["token_ids"])}
        if item.answer is not None:
            row["extracted"] = {"baseline": extract_answer(b["text"], item.regex),
                                "oea": extract_answer(o["text"], item.regex)}
        if item.reference is not None:
            row["reference_ids"] = item.reference
            row["reference_match"] = {"baseline": reference_match(b["token_ids"], item.reference),
                                      "oea": reference_match(o["token_ids"], item.reference)}
        rows.append(row)
    return rows


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_report(out_dir: str, items: Sequence[Item], arms: Dict[str, Dict]) -> Dict:
    """Writes quality.json, quality.md, outputs.jsonl; prints the table; returns the report."""
    report = build_report(items, arms["baseline"], arms["oea"], arms.get("baseline_repeat"))
    write_json(os.path.join(out_dir, "quality.json"), report)
    markdown = render_markdown(report)
    with open(os.path.join(out_dir, "quality.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(out_dir, "outputs.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in per_prompt_rows(items, arms["baseline"], arms["oea"]))
    print(markdown, end="")
    return report
