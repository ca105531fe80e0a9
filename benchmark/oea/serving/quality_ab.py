r"""Output quality A/B: the same prompts through a baseline server and an OEA server, as served.

OEA changes outputs only in decode batches of at least --oea-min-batch requests, so both arms send
the same prompts, in the same order, at the same fixed concurrency (a pool of N requests in
flight), greedy (temperature 0). The arms run one after the other, never at the same time.

    python benchmark/oea/serving/quality_ab.py --base-url http://127.0.0.1:30000 \
        --oea-url http://127.0.0.1:30001 --prompts prompts.jsonl --concurrency 16 \
        --max-tokens 256 --out quality_out

    # one server started with --oea-k0 (any value): OEA off (k0 0) for the baseline, k0 4 for the
    # OEA arm, set live; the server's own settings are put back at the end
    python benchmark/oea/serving/quality_ab.py --url http://127.0.0.1:30000 --k0 4 --prompts prompts.jsonl \
        --concurrency 16 --max-tokens 256 --out quality_out

    # one machine, one server at a time: save the baseline arm, restart with --oea-k0, compare
    python benchmark/oea/serving/quality_ab.py --base-url URL --prompts p.jsonl --concurrency 16 --out q
    python benchmark/oea/serving/quality_ab.py --oea-url URL --baseline-from q/arm_baseline.json \
        --prompts p.jsonl --concurrency 16 --out q
    # both arms saved: the report alone, no server
    python benchmark/oea/serving/quality_ab.py --baseline-from q/arm_baseline.json --oea-from q/arm_oea.json \
        --prompts p.jsonl --concurrency 16 --out q

Prompts: JSONL, one object a line: {"prompt": str | [token id, ...], "answer": str|number
(optional), "answer_regex": str (optional), "reference_ids": [token id, ...] (optional)}. A prompt
given as token ids is sent as ids (the completion `prompt` may be a list of ids), so the server sees
exactly those tokens. The extracted answer is the first group (or the whole match) of the first
match of the line's answer_regex, else --answer-regex, else the whole output; it is correct when it
equals the answer after stripping surrounding whitespace. `reference_ids` is a true continuation
(e.g. held-out text): each arm's reference match is the share of its generated positions whose
token id equals the reference's at that position.

Tokens are compared by id: SGLang's /v1/completions returns the generated ids in
choices[0].token_ids when asked with "return_token_ids": true (logprobs tokens are display
strings, and two ids can render the same).

Writes DIR/quality.json, DIR/quality.md (printed too), DIR/outputs.jsonl (per prompt) and
DIR/arm_<name>.json (each arm's raw outputs, reusable with --baseline-from / --oea-from).

Modules: quality_inputs.py (the prompts), quality_client.py (the requests), quality_scoring.py
(the measures), quality_report.py (the files), common/oea_metrics.py (the OEA step counters).
"""

import argparse
import json
import os
import sys
from typing import Dict, Optional, Sequence

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from serving.live_settings import (apply_settings, arm_settings, confirm_settings, current_settings,  # noqa: E402
                                   oea_states, read_server_info)
from serving.quality_client import run_arm  # noqa: E402
from serving.quality_inputs import InputError, Item, compile_regex, load_prompts, prompts_digest  # noqa: E402
from serving.quality_report import write_json, write_report  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="baseline server (OpenAI-compatible), e.g. http://127.0.0.1:30000")
    p.add_argument("--oea-url", help="OEA server, same model and flags plus --oea-*")
    p.add_argument("--baseline-from", help="reuse a saved baseline arm (arm_baseline.json) instead of --base-url")
    p.add_argument("--oea-from", help="reuse a saved OEA arm (arm_oea.json) instead of --oea-url")
    p.add_argument("--url", help="one server started with --oea-k0 (live settings): the baseline arm runs with "
                                 "oea_k0 0, the OEA arm with --k0, set live; its settings are put back at the end")
    p.add_argument("--k0", type=int, help="with --url: the OEA arm's k0 (>= 1)")
    p.add_argument("--admin-api-key", help="with --url: the server's --admin-api-key, for the live-settings POSTs")
    p.add_argument("--prompts", required=True,
                   help="JSONL: prompt (text or token ids), optional answer, answer_regex, reference_ids")
    p.add_argument("--answer-regex", help="default answer-extraction regex (first group, or the whole match)")
    p.add_argument("--concurrency", type=int, required=True, help="requests in flight, both arms")
    p.add_argument("--max-tokens", type=int, required=True, help="max output tokens per request")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (SGLang's ignore_eos)")
    p.add_argument("--model", help="model name in requests (default: the server's /v1/models, else 'default')")
    p.add_argument("--noise-floor", action="store_true",
                   help="run the baseline arm a second time and report baseline-vs-baseline agreement")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", required=True, help="output directory")
    return p


def check_args(args: argparse.Namespace) -> None:
    """InputError naming the flag for values argparse cannot check."""
    if args.concurrency < 1:
        raise InputError("--concurrency must be at least 1")
    if args.max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    if args.url:
        check_live_args(args)
        return
    if args.k0 is not None:
        raise InputError("--k0 goes with --url (the OEA server of --oea-url runs its own k0)")
    if args.noise_floor and not args.base_url:
        raise InputError("--noise-floor needs --base-url or --url")
    for url, saved, name in ((args.base_url, args.baseline_from, "baseline"), (args.oea_url, args.oea_from, "oea")):
        if url and saved:
            raise InputError(f"give either the {name} URL or a saved {name} arm, not both")
    if not (args.base_url or args.oea_url or (args.baseline_from and args.oea_from)):
        raise InputError("give --url, or --base-url and/or --oea-url (a missing arm may come from --baseline-from / "
                         "--oea-from)")


def check_live_args(args: argparse.Namespace) -> None:
    """InputError unless --url comes with --k0 >= 1 and without the two-server flags."""
    if args.base_url or args.oea_url or args.baseline_from or args.oea_from:
        raise InputError("--url runs both arms on one server: no --base-url/--oea-url/--baseline-from/--oea-from")
    if args.k0 is None or args.k0 < 1:
        raise InputError("--url needs --k0 >= 1 (the OEA arm; the baseline arm is k0 0)")


def load_arm(path: str, items: Sequence[Item], args: argparse.Namespace) -> Dict:
    """A saved arm, checked against these prompts and settings."""
    if not os.path.isfile(path):
        raise InputError(f"no such saved arm: {path}")
    try:
        with open(path) as f:
            arm = json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not a saved arm ({e})") from None
    want = {"prompts_sha256": prompts_digest(items), "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    for key, value in want.items():
        if arm.get(key) != value:
            raise InputError(f"{path}: {key} is {arm.get(key)!r}, this run has {value!r}")
    return arm


def collect_live_arms(items: Sequence[Item], args: argparse.Namespace) -> Dict[str, Dict]:
    """--url: baseline (oea_k0 0), OEA (--k0) and, with --noise-floor, the baseline again, on one
    server, each set live (accepted by every scheduler before the arm, in force on every scheduler
    after it: its first request's pass applies it), each saved as DIR/arm_<name>.json with the
    states read after it; the server's OEA settings are put back at the end, also on error.
    LiveSettingsError when the server does not take or confirm a setting."""
    url = args.url.rstrip("/")
    original = current_settings(oea_states(read_server_info(url), url), ("oea_k0",), url)
    plan = [("baseline", 0), ("oea", args.k0)] + ([("baseline_repeat", 0)] if args.noise_floor else [])
    arms = {}
    try:
        for name, k0 in plan:
            states = oea_states(apply_settings(url, arm_settings(k0), args.admin_api_key), url)
            print(f"[quality] {url}: oea_k0 {k0} accepted by {len(states)} scheduler(s)", flush=True)
            arm = run_arm(name, url, items, args)
            arms[name] = {**arm, "oea_live": arm_settings(k0), "oea_states": confirm_settings(url, arm_settings(k0))}
            write_json(os.path.join(args.out, f"arm_{name}.json"), arms[name])
    finally:
        restore_settings(url, original, args.admin_api_key)
    return arms


def restore_settings(url: str, original: Dict[str, int], admin_api_key: Optional[str]) -> None:
    """Put the server's OEA settings back; a failure is printed, not raised (it would hide the
    error that ended the arms)."""
    try:
        apply_settings(url, original, admin_api_key)
        print(f"[quality] {url}: restored {original}", flush=True)
    except RuntimeError as e:
        print(f"quality_ab.py: WARNING: could not restore the server's OEA settings {original}: {e}", file=sys.stderr)


def collect_arms(items: Sequence[Item], args: argparse.Namespace) -> Dict[str, Dict]:
    """Loads the saved arms (checked first: a bad file fails before any request), then runs the
    arms that have a URL one after the other, saving each as DIR/arm_<name>.json (--url: see
    collect_live_arms)."""
    if args.url:
        return collect_live_arms(items, args)
    arms = {name: load_arm(path, items, args)
            for name, path in (("baseline", args.baseline_from), ("oea", args.oea_from)) if path}
    plan = [("baseline", args.base_url), ("oea", args.oea_url)]
    plan += [("baseline_repeat", args.base_url)] if args.noise_floor else []
    for name, url in plan:
        if url:
            arms[name] = run_arm(name, url, items, args)
            write_json(os.path.join(args.out, f"arm_{name}.json"), arms[name])
    return arms


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 done, 2 bad input, 1 a server failed."""
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        default_regex = compile_regex(args.answer_regex, "--answer-regex") if args.answer_regex else None
        items = load_prompts(args.prompts, default_regex)
        os.makedirs(args.out, exist_ok=True)
        arms = collect_arms(items, args)
    except InputError as e:
        print(f"quality_ab.py: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # HTTP errors, refused connections, timeouts, live settings refused
        print(f"quality_ab.py: server error: {e}", file=sys.stderr)
        return 1
    if "baseline" not in arms or "oea" not in arms:
        print(f"[quality] saved {', '.join(arms)} in {args.out}; run again for the other arm to get the report")
        return 0
    write_report(args.out, items, arms)
    return 0


if __name__ == "__main__":
    sys.exit(main())