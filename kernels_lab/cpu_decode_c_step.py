"""Chapter 10f's decode step in one C call against the engine's PyTorch step (chapter 07a with chapter 09a's CPU
layers), on SmolLM2-135M-Instruct's GGUF file (Q4_1 layers, a Q8_0 head): milliseconds of one decode step of 1, 2,
4, 8 and 16 sequences with 64 tokens of context each (best mean of 5 rounds), on the threads PyTorch has, and the
LM head's share. What the engine's choice rests on: which steps go to the C call.

Run anywhere from the repository root (the model must be in the cache: `forge-engine models pull
smollm2-135m-instruct`; a C compiler builds the kernels): PYTHONPATH=. python3 kernels_lab/cpu_decode_c_step.py"""

from common import best_host_s  # first: it may switch on the interpreter (these ops do not care)
import torch

from forge_engine.cpu_decode import CPUDecodeRunner
from forge_engine.fused_layers import install_cpu_layers
from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout
from forge_engine.loader import load_model

model = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf").model
install_cpu_layers(model)
context, size = 64, 16
print(f"{torch.get_num_threads()} threads, {context} tokens of context a sequence")
torch.manual_seed(0)
with torch.inference_mode():
    for rows in (1, 2, 4, 8, 16):
        per_seq = context // size
        cache = PagedKVCache(model.config, rows * per_seq, size)
        cache.k_cache.normal_(), cache.v_cache.normal_()
        tables = [list(range(r * per_seq, (r + 1) * per_seq)) for r in range(rows)]
        ids = torch.randint(0, model.config.vocab_size, (rows,))
        runner = CPUDecodeRunner(model, cache, max_rows=rows)

        def eager():
            layout = build_step_layout([(t, context - 1, 1) for t in tables], size)
            hidden = model(ids, layout.positions, PagedAttention(cache, layout))
            return model.compute_logits(hidden[layout.last_token_index])

        def c_step():
            slots = [t[-1] * size + size - 1 for t in tables]
            return runner.run(ids.tolist(), [context - 1] * rows, slots, tables, [context] * rows)

        e, c = best_host_s(eager, reps=10), best_host_s(c_step, reps=10)
        hidden = torch.randn(rows, model.config.hidden_size)
        head = best_host_s(lambda: model.compute_logits(hidden), reps=10)
        print(
            f"{rows:2d} rows  pytorch step {e * 1e3:6.2f} ms   c step {c * 1e3:6.2f} ms   {e / c:4.2f}x"
            f"   (of which the LM head {head * 1e3:5.2f} ms)"
        )
