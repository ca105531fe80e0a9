"""Host CPU cost of one routed decode pass through OEARuntime (begin_step, route x L layers, end_step),
with counting on (the default), at k0 = 0 (armed, off) and k0 = 4, for the code under sys.argv[1]/python.
Prints json: {k0: [us per pass, one per repeat]}."""
import json, sys, time, types
sys.path.insert(0, sys.argv[1] + "/python")
import torch
torch.set_num_threads(1)
from sglang_oea.config import OEAConfig, LiveSettings
from sglang_oea.runtime import OEARuntime, DECODE
B, N, K, L = 16, 128, 8, 4
cfg = types.SimpleNamespace(top_k=K, num_shared_topk_slots=0, allow_routed_experts_capture=True, scoring_func="softmax",
                            correction_bias=None, num_expert_group=None, topk_group=None, use_grouped_topk=False,
                            custom_routing_function=None, renormalize=True)
gen = torch.Generator().manual_seed(0)
layers = []
for l in range(L):
    logits = torch.randn(B, N, generator=gen)
    w, ids = torch.topk(logits.softmax(1), K, sorted=False)
    layers.append((logits, ids.int(), w))
out = {}
for k0 in (0, 4):
    rt = OEARuntime(OEAConfig(k0=4, min_batch=1, kernel="torch"))
    def one():
        rt.begin_step(DECODE, B)
        for l, (logits, ids, w) in enumerate(layers):
            rt.route(ids, w, cfg, logits, l)
        rt.end_step()
    one(); one()
    rt.request_settings(LiveSettings(k0, 1, 0))
    for _ in range(50): one()
    reps = []
    for _ in range(int(sys.argv[2])):
        t = time.perf_counter()
        for _ in range(400): one()
        reps.append((time.perf_counter() - t) / 400 * 1e6)
    out[k0] = reps
print(json.dumps(out))
