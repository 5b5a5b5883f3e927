"""GPU time of one batch-1 decode step of random:qwen3-4b: the decode CUDA graph replayed alone between CUDA events,
then the same step eager under the torch profiler, kernel by kernel (launches per step, ms per step).
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/decode_step_profile.py"""

import torch, time
from torch.profiler import profile, ProfilerActivity
from forge_engine.loader import load_model
from forge_engine.engine import LLMEngine
from forge_engine.config import EngineConfig
from forge_engine.generate import SamplingParams

lm = load_model("random:qwen3-4b", "cuda", progress=False)
p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
eng = LLMEngine(lm, EngineConfig(max_num_seqs=8))
eng.add_request(list(range(100, 228)), p)
for _ in range(10):
    eng.step()
d = eng.runner.decode
key = (1, d.widths[0], False)
g = d.graphs[key]
torch.cuda.synchronize()
for reps in (50, 200):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    print(f"graph replay (1 seq, layers + logits): {a.elapsed_time(b) / reps:.3f} ms over {reps}")
while eng.has_unfinished():
    eng.step()
# eager: same model without graphs, kernels listed
del eng, d, g
import gc

gc.collect()
torch.cuda.empty_cache()
eng2 = LLMEngine(
    lm,
    EngineConfig(max_num_seqs=8, cuda_graphs=False, async_scheduling=False, kv_cache_bytes=2**30),
)
eng2.add_request(list(range(100, 228)), p)
for _ in range(5):
    eng2.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(4):
        eng2.step()
    torch.cuda.synchronize()
ka = prof.key_averages()
rows = sorted(
    [(e.key, e.count, e.device_time_total) for e in ka if e.device_time_total > 0],
    key=lambda r: -r[2],
)
total = sum(r[2] for r in rows)
print(
    f"eager: {sum(r[1] for r in rows) / 4:.0f} kernels/step, {total / 4 / 1000:.3f} ms GPU per step"
)
for k, c, t in rows[:30]:
    print(f"  {t / 4 / 1000:8.3f} ms/step {c / 4:6.0f}/step  {k[:110]}")
while eng2.has_unfinished():
    eng2.step()
