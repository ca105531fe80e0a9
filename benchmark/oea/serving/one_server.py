"""The one-server sweep: every arm on one warm server, OEA switched live between runs.

The server runs with the plugin armed and OEA off (`--oea-k0 0`); the baseline arm is `oea_k0` 0
(SGLang's own routing), each OEA arm its k0 (plus the batch gate when given), set through
POST /set_internal_state and confirmed through /server_info on every scheduler
(serving/live_settings.py). Launched here (`sglang serve ... --oea-k0 0 --enable-metrics`), or a
server the user runs (`--url`), whose settings are put back at the end.

Order. A block is one (concurrency, repeat); blocks run concurrency by concurrency, repeat by
repeat, and every block runs each arm once: in the given order (baseline first) in even blocks,
reversed in odd ones, counted over the whole sweep:

    C=4:  r0  A B1 B2 | r1  B2 B1 A | r2  A B1 B2    C=16:  r0  B2 B1 A | ...

Reversing rather than rotating: a drift that is linear in time biases the ratio of arm B to A in
one block by (position of B - position of A) times the drift; reversing flips that sign every
block, so it cancels for every (baseline, arm) pair over any two blocks, whatever the number of
arms (a rotation needs as many blocks as arms), and what is left shows as spread between repeats,
not as a shift of the median. It also saves a switch per block: the last arm of a block is the
first of the next.

Switch. When the next run's arm differs from the one set last, its settings are POSTed and every
scheduler must accept them (report them in force, or pending until its next forward pass). Before
every measured run /server_info is read again: once a pass has run since the switch (a warm-up, or
an earlier run), every scheduler must have them in force with nothing else pending. Anything else
stops the sweep with LiveSettingsError. When the arm or the concurrency changed, an unrecorded
warm-up run comes first: --switch-warmup-prompts prompts (default C, one wave at the run's
concurrency) of --switch-warmup-output-len tokens (default the server's decode-log interval + 8).
It also applies a pending change before the measured run starts. OEA's counters reach /metrics once per decode-log interval, so a
warm-up that long sees at least one export: every step of the previous arm is exported before the
next measured run's counters are read, and a run's oea_metrics_delta holds this arm's steps only
(exact with --decode-log-interval 1; otherwise shifted by less than one interval).
"""

import json
import os
import time
from typing import List, Optional, Sequence, Set, Tuple

from serving.bench_client import BenchClient
from serving.live_settings import (apply_settings, confirm_settings, current_settings, decode_log_interval,
                                   oea_states, read_server_info)
from common.oea_metrics import scrape_oea_metrics
from serving.prompt_files import switch_warmup_prompts
from serving.servers import Server, child_env, launcher_command, log, port_in_use, wait_ready
from serving.sweep import Arm, measure_run, run_warm_up, warm_up

ONE_SERVER = "one-server"  # the server_mode of a record measured here (launched)
LIVE_URL = "url"  # ... on the user's server (--url)


def block_order(arms: Sequence[Arm], block: int) -> List[Arm]:
    """The arms of block `block` (0, 1, ...): as given when even, reversed when odd."""
    return list(arms) if block % 2 == 0 else list(reversed(arms))


def plan_runs(arms: Sequence[Arm], concurrencies: Sequence[int], repeats: int) -> List[Tuple[int, int, int, Arm]]:
    """Every measured run in order: [(block, concurrency, repeat, arm)], blocks numbered over the sweep."""
    plan, block = [], 0
    for conc in concurrencies:
        for rep in range(repeats):
            plan += [(block, conc, rep, arm) for arm in block_order(arms, block)]
            block += 1
    return plan


def one_server_flags(args, server_args: Sequence[str]) -> List[str]:
    """What the launched server adds to the user's arguments: --oea-k0 0 (armed, off), the batch
    gate when given, --enable-metrics unless given. SystemExit when the user's arguments set --oea-k0."""
    if any(a == "--oea-k0" or a.startswith("--oea-k0=") for a in server_args):
        raise SystemExit("one-server mode starts the server with --oea-k0 0 and sets k0 live: remove --oea-k0 "
                         "from the server arguments (or use --two-servers)")
    flags = ["--oea-k0", "0"]
    if args.oea_min_batch is not None:
        flags += ["--oea-min-batch", str(args.oea_min_batch)]
    if args.oea_max_batch is not None:
        flags += ["--oea-max-batch", str(args.oea_max_batch)]
    return flags + ([] if "--enable-metrics" in server_args else ["--enable-metrics"])


def run_one_server(arms: Sequence[Arm], args, server_args: Sequence[str], jsonl_path: str) -> int:
    """Every run of every arm on one server: launched on --host/--port (stopped at the end, its whole
    process group), or --url (its settings put back at the end). Returns the number of failed runs;
    LiveSettingsError when the server does not take or confirm a setting."""
    client = BenchClient(args, ONE_SERVER)
    server = None
    try:
        if args.url:
            base_url = args.url.rstrip("/")
            wait_ready(base_url, args.ready_timeout)
        else:
            server, base_url = launch_server(args, server_args, client)
        sweep = LiveSweep(arms, base_url, args, client, server, jsonl_path)
        try:
            return sweep.run()
        finally:
            if args.url:
                sweep.restore()
    finally:
        client.close()
        if server is not None:
            server.stop()


def launch_server(args, server_args: Sequence[str], client: BenchClient) -> Tuple[Server, str]:
    """Start the one server (armed, OEA off) and wait until it answers; the bench client's import
    overlaps its start-up. Returns (server, its URL)."""
    if port_in_use(args.host, args.port):
        raise RuntimeError(f"{args.host}:{args.port} is already in use; stop that server or pick --port")
    base_url = f"http://{args.host}:{args.port}"
    cmd = (launcher_command(args) + ["--model-path", args.model_path, "--host", args.host, "--port", str(args.port)]
           + list(server_args) + one_server_flags(args, server_args))
    server = Server(cmd, os.path.join(args.out_dir, f"server_{ONE_SERVER}.log"), child_env())
    try:
        client.start()
        wait_ready(base_url, args.ready_timeout, server.proc, server.log_path)
    except BaseException:
        server.stop()
        raise
    return server, base_url


class LiveSweep:
    """One server's sweep: the settings in force, the switches, warm-ups and measured runs."""

    def __init__(self, arms: Sequence[Arm], base_url: str, args, client: BenchClient, server: Optional[Server],
                 jsonl_path: str):
        self.arms, self.base_url, self.args = list(arms), base_url, args
        self.client, self.server, self.jsonl_path = client, server, jsonl_path
        self.runs_dir = os.path.join(args.out_dir, "runs")
        os.makedirs(self.runs_dir, exist_ok=True)
        info = read_server_info(base_url)
        self.original = current_settings(oea_states(info, base_url), base_url=base_url)
        self.interval = decode_log_interval(info)
        self.mode = LIVE_URL if args.url else ONE_SERVER
        self.in_force: Optional[Arm] = None  # the arm whose settings were set last
        self.passed = False  # whether the server ran a forward pass (a warm-up or a run) since then
        self.saved_info: Set[str] = set()  # arms whose server_info_<arm>.json is written
        self.last: Optional[Tuple[str, int]] = None  # (arm, concurrency) of the last run or warm-up

    def run(self) -> int:
        """Start-up warm-up, then every planned run. Returns the number of failed runs."""
        self.start()
        plan = plan_runs(self.arms, self.args.concurrency, self.args.repeats)
        failures = 0
        for i, (block, conc, rep, arm) in enumerate(plan):
            if not self.measure(arm, conc, rep, block, f"[run {i + 1}/{len(plan)}]"):
                failures += 1
                if self.server is not None and not self.server.alive():
                    log("the server died; skipping the remaining runs")
                    break
        return failures

    def start(self) -> None:
        """Before the first run: the bench client ready, the first arm set, the start-up warm-up."""
        log(f"one server at {self.base_url}: OEA settings now {self.original}, decode-log interval {self.interval}")
        if scrape_oea_metrics(self.base_url) is None:
            log("WARNING: the server has no /metrics (start it with --enable-metrics): T will not be recorded")
        self.client.ensure_ready()
        self.switch(self.arms[0])
        if self.args.warmup_prompts > 0:
            warm_up(self.arms[0], self.base_url, self.args, self.client, self.runs_dir)
            self.passed = True

    def measure(self, arm: Arm, conc: int, rep: int, block: int, progress: str) -> bool:
        """Switch to arm (and warm up) when needed, confirm its settings, then one recorded run.
        True when it measured. The settings must be in force once a pass has run since the switch
        (without a warm-up, the run's own first pass applies them: accepted is enough then)."""
        if self.in_force is not arm:
            self.switch(arm)
        if self.last != (arm.name, conc):
            self.warm_up(arm, conc, rep)
        self.last = (arm.name, conc)
        states = confirm_settings(self.base_url, arm.live, in_force=self.passed)
        extra = {"server_mode": self.mode, "oea_live": arm.live, "oea_states": states,
                 "block": block, "position": block_order(self.arms, block).index(arm)}
        stem = os.path.join(self.runs_dir, f"{arm.name}_c{conc}_r{rep}")
        measured = measure_run(arm, self.base_url, self.args, self.client, self.server, conc, rep, stem,
                               self.jsonl_path, progress, extra)
        self.passed = self.passed or measured
        return measured

    def switch(self, arm: Arm) -> None:
        """Set arm's settings and check that every scheduler accepted them (LiveSettingsError
        otherwise); the first accepting /server_info of each arm is kept as server_info_<arm>.json."""
        t0 = time.time()
        info = apply_settings(self.base_url, arm.live, self.args.admin_api_key)
        if arm.name not in self.saved_info:
            with open(os.path.join(self.args.out_dir, f"server_info_{arm.name}.json"), "w") as f:
                json.dump(info, f, indent=1)
            self.saved_info.add(arm.name)
        log(f"switched to {arm.name} {arm.live}: accepted by {len(oea_states(info))} scheduler(s) "
            f"in {time.time() - t0:.1f}s")
        self.in_force, self.passed = arm, False

    def warm_up(self, arm: Arm, conc: int, rep: int) -> None:
        """The unrecorded run after a switch or a change of concurrency (none when its prompts are 0)."""
        prompts = switch_warmup_prompts(conc, self.args)
        if prompts <= 0:
            return
        output_len = self.args.switch_warmup_output_len or self.interval + 8
        run_warm_up(self.client, self.base_url, self.args, conc, prompts, output_len,
                    os.path.join(self.runs_dir, f"{arm.name}_c{conc}_r{rep}_warmup"), arm.name)
        self.passed = True

    def restore(self) -> None:
        """--url mode: put back the settings the server had before the sweep (logged, never raised)."""
        touched = {key for arm in self.arms for key in (arm.live or {})}
        settings = {k: v for k, v in self.original.items() if k in touched}
        try:
            apply_settings(self.base_url, settings, self.args.admin_api_key)
            log(f"restored the server's OEA settings {settings}")
        except RuntimeError as e:
            log(f"WARNING: could not restore the server's OEA settings {settings}: {e}")
