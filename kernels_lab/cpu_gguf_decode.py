"""A laptop's GGUF decode, end to end on a CPU, with chapter 10da's weight prefetch and without it. The model is
random Qwen3-4B-shaped weights, the first LAB_LAYERS (default 8) of its 36 layers, written by chapter 01a's writer as
a GGUF file (Q4_1 matrices, a Q8_0 tied embedding and head: 0.92 GB for 8 layers, more than a CPU's caches) and loaded
with its blocks kept (chapter 10e). One request, a 128-token prompt and 64 new tokens, greedy, through the engine
(chapter 10f's C decode step): the decode ms a step after the first token, best of 3 runs.

Each variant runs in a process of its own, the kernels built with PREFETCH_BYTES as exported (4096) or 0 (no prefetch;
both chapter 10da's kernel and chapter 10f's step, which compiles the same source). The tokens of the two must agree:
prefetching changes no result.

On a 2-core Xeon (AVX-512 VNNI), 8 layers: 57.8 ms a decode step with the prefetch, 100.1 ms without (1.73x), the
same tokens.

Run anywhere from the repository root (a C compiler and the `gguf` package):
    PYTHONPATH=. python3 kernels_lab/cpu_gguf_decode.py"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYERS = int(os.environ.get("LAB_LAYERS", 8))
PROMPT, NEW, RUNS = 128, 64, 3
EXPORTED = "enum { PREFETCH_BYTES = 4096 };"


def write_file(path: Path) -> None:
    "The GGUF file: random Qwen3-4B-shaped weights, LAYERS layers, Q4_1 matrices and a Q8_0 embedding."
    from gguf import GGMLQuantizationType as QType

    from forge_engine.config import preset
    from forge_engine.gguf_file import write_gguf
    from forge_engine.model import empty_model, hf_state_dict, init_random_weights

    config = preset("qwen3-4b").replace(num_layers=LAYERS)
    state = {
        k: v.contiguous()
        for k, v in hf_state_dict(init_random_weights(empty_model(config), 0, std=0.02)).items()
    }
    qtypes = {k: QType.Q4_1 for k in state if "proj" in k}
    qtypes["model.embed_tokens.weight"] = QType.Q8_0
    write_gguf(path, config, state, qtypes)


def decode_ms(path: Path, prefetch: int) -> tuple[float, list[int]]:
    "This process: the kernels built with PREFETCH_BYTES = prefetch, then the best decode ms a step, and the tokens."
    import forge_engine.cpu_decode as cpu_decode
    import forge_engine.quant.cpu_gguf as cpu_gguf

    assert EXPORTED in cpu_gguf.GGUF_CPU_SOURCE, "the source no longer says PREFETCH_BYTES = 4096"
    source = cpu_gguf.GGUF_CPU_SOURCE.replace(EXPORTED, f"enum {{ PREFETCH_BYTES = {prefetch} }};")
    cpu_gguf.GGUF_CPU_SOURCE = cpu_decode.GGUF_CPU_SOURCE = source  # before anything builds them
    from forge_engine.config import EngineConfig
    from forge_engine.engine import LLMEngine
    from forge_engine.generate import SamplingParams
    from forge_engine.gguf_file import GGUFFile
    from forge_engine.loader import LoadedModel
    from forge_engine.quant.layers import load_gguf_quantized

    model = load_gguf_quantized(GGUFFile(path), "cpu", torch.float32)
    engine = LLMEngine(
        LoadedModel("random-qwen3-4b-gguf", model, None, None), EngineConfig(max_num_seqs=1)
    )
    best, tokens = float("inf"), None
    for run in range(RUNS):
        engine.add_request(
            [(100 + 7 * i + run) % 5000 for i in range(PROMPT)],
            SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
        )
        first = final = None
        while engine.has_unfinished():
            for out in engine.step():
                first = first or (time.perf_counter() if out.token_ids else None)
                final = out
        best = min(best, (time.perf_counter() - first) / (len(final.token_ids) - 1) * 1e3)
        tokens = tokens or list(final.token_ids)
    return best, tokens


def main():
    if len(sys.argv) == 3:  # a variant's own process: python3 cpu_gguf_decode.py FILE PREFETCH
        print(json.dumps(decode_ms(Path(sys.argv[1]), int(sys.argv[2]))))
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "random-qwen3-4b.gguf"
        write_file(path)
        print(
            f"{path.stat().st_size / 1e9:.2f} GB, {LAYERS} layers; {torch.get_num_threads()} threads"
        )
        results = {}
        for prefetch in (4096, 0):
            out = subprocess.run(
                [sys.executable, __file__, str(path), str(prefetch)],
                capture_output=True,
                text=True,
                check=True,
            )
            results[prefetch] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"PREFETCH_BYTES = {prefetch:4d}: {results[prefetch][0]:.2f} ms a decode step")
        same = results[4096][1] == results[0][1]
        print(
            f"prefetch: {results[0][0] / results[4096][0]:.2f}x; tokens {'equal' if same else 'DIFFER'}"
        )
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
