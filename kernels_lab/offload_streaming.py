"""Chapter 10h's other mode, measured before it is built: the layers past the GPU's kept in pinned host memory and
streamed to the GPU every step, computed there by its kernels (not by the CPU).

Napkin math: chapter 10h's plan for Qwen3-14B int4 under 8 GiB keeps 24 of 40 layers on the GPU and 2.62 GiB of
layers elsewhere. Streamed, a decode step copies those 2.62 GiB over PCIe: at 54.9 GB/s (pinned, host to GPU, an H100
machine's figure from offload_bandwidth.py) 51.2 ms, about 19.5 tok/s, against the CPU-compute floor of 48.2 ms on
the same machine. But the CPU-compute mode measured 217 ms a step there (the CPU's int4 products read its memory at
about a quarter of its bandwidth), while a copy engine runs at its rate and the GPU computes a streamed layer in well
under a millisecond. So streaming should land near its floor, about 4x the CPU mode on that machine.

How the lab streams (the smallest version that measures it):
- the model is quantized whole onto the GPU (the lab has the memory; the product would quantize the streamed layers
  there one at a time), then each layer from FIRST on hands its four matrices' tensors to pinned host memory and
  points them at one of two GPU slots (layers FIRST, FIRST + 2, ... share slot 0; the others slot 1);
- before a streamed layer runs, the compute stream waits for its slot's copy; after it runs, the copy stream waits
  for it and fills the slot with the layer two on (past the last, the first ones of the next step);
- the norms stay on the GPU (a few KB; the fused decode hands a layer's norm to the layer before), the KV cache of
  every layer is on the GPU, the steps run eager, each layer called as a module (forward hooks).

1. On a CPU (no GPU: copies without streams): SmolLM2 (30 layers), fp32; greedy tokens with layers 1.. streamed
   (29 layers through two slots) equal those of the model whole.
2. On a GPU: random Qwen3-14B int4, one W1 request (128 prompt tokens, 64 new) whole on the GPU, then with layers
   FIRST.. streamed; decode tok/s against the streaming floor (streamed bytes / pinned PCIe bandwidth), and the GPU
   memory the streamed model holds (resident layers, two slots, the KV cache).

Run from the repository root: PYTHONPATH=. python3 kernels_lab/offload_streaming.py"""

import torch

from forge_engine.bench import free_memory, w1_single_stream
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.model import Transformer
from forge_engine.offload import pcie_bandwidth
from forge_engine.quant.layers import QUANTIZED_LINEARS

GIB = 2**30
MODEL, QUANTIZATION, FIRST = "qwen3-14b", "int4", 24


class LayerStreamer:
    """Layers from `first` on: their matrices' tensors in host memory (pinned on a GPU machine), run from two slots on
    `device`, each filled ahead (on a copy stream) with the next layer that runs from it."""

    def __init__(self, model: Transformer, first: int, device: torch.device):
        self.first, self.last = first, len(model.layers) - 1
        self.cuda = device.type == "cuda"
        tensors = [self.matrix_tensors(layer) for layer in model.layers]
        shapes = [[(t.shape, t.dtype) for t in ts] for ts in tensors[first:]]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("streamed layers must hold matrices of one shape and type")
        self.host = {
            i: [t.detach().cpu().pin_memory() if self.cuda else t.detach().clone() for t in ts]
            for i, ts in enumerate(tensors)
            if i >= first
        }
        self.slots = [
            [torch.empty(s, dtype=d, device=device) for s, d in shapes[0]]
            for _ in range(min(2, len(self.host)))
        ]
        for i in self.host:  # the layer's tensors now live in its slot (their own storage is freed)
            for t, s in zip(tensors[i], self.slots[self.slot(i)]):
                t.data = s
        self.filled = [None] * len(self.slots)
        if self.cuda:
            self.copier = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event() for _ in self.slots]
            self.used = [torch.cuda.Event() for _ in self.slots]
        for i, layer in enumerate(model.layers):
            if i >= first:
                layer.register_forward_pre_hook(lambda *_, i=i: self.before(i))
                layer.register_forward_hook(lambda *_, i=i: self.after(i))
        for i in sorted(self.host)[: len(self.slots)]:
            self.fill(i)

    @staticmethod
    def matrix_tensors(layer) -> list[torch.Tensor]:
        return [
            t
            for name in QUANTIZED_LINEARS
            for t in (*layer.get_submodule(name).parameters(), *layer.get_submodule(name).buffers())
        ]

    def slot(self, i: int) -> int:
        return (i - self.first) % len(self.slots)

    def fill(self, i: int) -> None:
        "Copy layer i's matrices into its slot once the layer before it in that slot has run."
        s = self.slot(i)
        if self.filled[s] == i:
            return
        if not self.cuda:
            for dst, src in zip(self.slots[s], self.host[i]):
                dst.copy_(src)
        else:
            with torch.cuda.stream(self.copier):
                self.copier.wait_event(self.used[s])
                for dst, src in zip(self.slots[s], self.host[i]):
                    dst.copy_(src, non_blocking=True)
                self.copied[s].record(self.copier)
        self.filled[s] = i

    def before(self, i: int) -> None:
        self.fill(i)  # (a no-op when filled ahead)
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied[self.slot(i)])

    def after(self, i: int) -> None:
        s = self.slot(i)
        if self.cuda:
            self.used[s].record(torch.cuda.current_stream())
        following = i + len(
            self.slots
        )  # the next layer of this slot, this step's or the next step's
        self.fill(following if following <= self.last else self.first + s)


def stream(loaded, first: int) -> LayerStreamer:
    "Stream `loaded`'s layers from `first` on; its steps then call every layer as a module (the hooks' way)."
    model = loaded.model
    streamer = LayerStreamer(model, first, next(model.parameters()).device)
    model.run_layers = Transformer.run_layers.__get__(model)  # no norm handed between layers
    return streamer


def greedy(loaded, config, prompt, n=24) -> list[int]:
    engine = LLMEngine(loaded, config)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    return list(final.token_ids)


def cpu_check() -> None:
    config = EngineConfig(max_num_seqs=1, kv_cache_bytes=2**24, cuda_graphs=False)
    prompt = list(range(5, 45))
    loaded = load_model("smollm2-135m-instruct", "cpu", dtype=torch.float32, progress=False)
    want = greedy(loaded, config, prompt)
    stream(loaded, 1)
    got = greedy(loaded, config, prompt)
    assert got == want, (got, want)
    print(
        f"CPU, SmolLM2, layers 1.. streamed: the same {len(got)} greedy tokens as the model whole"
    )


def gpu_run() -> None:
    pcie, _ = pcie_bandwidth()
    config = EngineConfig(max_num_seqs=1, kv_cache_bytes=GIB, cuda_graphs=False)
    loaded = load_model(f"random:{MODEL}", "cuda", quantization=QUANTIZATION, progress=False)
    whole = w1_single_stream(loaded, config, prompt_len=128, new_tokens=64, repeats=1)[
        "decode_tok_s"
    ]
    print(f"W1 {MODEL} {QUANTIZATION} whole on the GPU, eager: {whole:.1f} tok/s")
    streamer = stream(loaded, FIRST)
    free_memory()
    streamed = sum(t.numel() * t.element_size() for ts in streamer.host.values() for t in ts)
    torch.cuda.reset_peak_memory_stats()
    rate = w1_single_stream(loaded, config, prompt_len=128, new_tokens=64, repeats=1)[
        "decode_tok_s"
    ]
    floor = streamed / pcie
    print(
        f"W1 with layers {FIRST}.. streamed ({streamed / GIB:.2f} GiB a step over PCIe at {pcie / 1e9:.1f} GB/s): "
        f"{rate:.1f} tok/s, {1e3 / rate:.1f} ms a step against the streaming floor {floor * 1e3:.1f} ms; "
        f"GPU memory held {torch.cuda.max_memory_allocated() / GIB:.2f} GiB (KV cache 1.00 GiB)"
    )


if __name__ == "__main__":
    if torch.cuda.is_available():
        gpu_run()
    else:
        cpu_check()
