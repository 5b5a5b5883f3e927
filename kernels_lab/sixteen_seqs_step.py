"""Where a decode step of 16 sequences goes on a GGUF Q8_0 file's layers (chapter 10g's int8 planes with fp16 scales
per 32 inputs), and what `sixteen_rows_swap.py`'s kernel changes end to end: llama_cpp_cuda_peer.py's 16-sequence
figure without a file. The model is random:qwen3-4b with every matrix and the tied head as random int8 planes of the
Q8_0 shape (`Int8GroupLinear`, as the loader repacks a Q8_0 file), so no file and no `gguf` package are needed.

Per variant, in turn (`export`: the package, 2-16 rows through chapter 09's rows_matmul; `split`: 2-16 rows through
chapter 10g's split-K and the separate small kernels, as before; `head_split`: only the LM head's rows on split-K;
`tile=BN/BK/W/ST`: rows_matmul in that tile; `programs=N`: its launches split along K
to about N programs an SM (as exported: 8 for int8 weights, 4 for BF16 and int4); `swap`: 5-16 rows through sixteen_rows_swap.py's kernel in its tile
LAB_SWAP, default 128,128,4,3,2; `folded`: steps of up to 16 rows through folded_rows_matmul.py's kernel in its tile
LAB_FOLDED, default 64,128,4,3, the norms handed off between the matrices and SwiGLU and the residual adds folded in;
`folded_int8`: the same with x quantized to int8 and int8 products; `folded4`, with LAB_PLANES=q4_k (every layer matrix
as random Q4_K planes, chapter 10's int4): 2-16 rows through that kernel's int4 tiles, not chapter 10's split-K
(one sequence's steps too); `dependent=N`: the step's small kernels and decode attention launched as
dependents up to N rows, chapter 09_kernels_gemv's DEPENDENT_LAUNCH_MAX_ROWS; `NAME=N`: the kernels' constant NAME set
to N, as DECODE_TARGET_PROGRAMS=512; each variant keeps the ones before it),
printed:
  - the decode rate at 16 sequences as llama-batched-bench counts it (S_TG: 16 prompts of 128 tokens, 128 new tokens
    each; the run to 129 tokens minus the run to 1), and at 1 sequence (W1-like);
  - the 16-row decode graph replayed alone, and its kernels by name (decode_step_timeline.py's table).

Measured on one H100 (`export,dependent=16`): the package gives S_TG 4,244 tok/s at 16 sequences and 453.8 at one.
Its 16-row graph replays in 3.697 ms: the 145 int8 matmuls take 2,923 us (the 4.3 GB at 1.5 TB/s), decode attention
366, the split sums 207, add+RMSNorm 156. Launched as dependents up to 16 rows (the split-K matmuls and their sums too,
in a version of chapter 10b tried for this and not kept): 3.621 ms a replay, S_TG 4,102 tok/s, no gain.
On one H200 (`export`): S_TG 4,358 tok/s at 16 sequences and 516.0 at one; the 16-row graph 3.615 ms, its int8
matmuls 2,885 us (1.48 TB/s), decode attention 345, the split sums 206, add+RMSNorm 159.
H100, `export,DECODE_TARGET_PROGRAMS=512` (twice the attention's programs, so splits of 128 keys rather than 256): the
graph 3.816 ms against 3.711, decode attention 12.6 µs a layer against 9.7 (S_TG 4,370 against 4,196 tok/s, within
its spread); `folded_int8` (x quantized to int8, int8 products): 8.342 ms, the 16-row step more than twice as slow.

With 2-16 rows through chapter 09's rows_matmul, on one H100 (`export,split`): the 16-row graph 3.210 ms against 3.722,
S_TG 4,872 against 4,204 tok/s (one sequence 446.8 and 445.1); rows_matmul's 143 launches 2,569 us, the LM head's two
split-K launches 214, decode attention 395. Its tile (`export,tile=...`, the graph): 32/128/2/3 3.215 ms, 32/256/2/3
3.198, 32/128/2/4 3.480, 32/128/4/3 3.537, 64/128/4/3 3.560, 16/256/2/3 3.829, 32/256/4/3 3.865, 32/128/1/3 3.899,
64/256/4/3 4.022. Those runs had the LM head's rows on split-K; through rows_matmul too (then a variant of its own, now
as exported; `head_split` is the reverse), in one run: 3.126 ms against 3.166, S_TG 5,039 against 4,948 tok/s (`split`,
in a process of its own: 3.682 ms).

int4 steps of 2-16 rows through rows_matmul, one H100 (`LAB_PLANES=int4|q4_k|q4_k_m ... export,split`, the graph):
int4 (groups of 128) 3.026 ms in the BF16 tile, 2.623 in 64/128/4/3 (`tile=64/128/4/3`, now int4's own tile), against
3.287 on split-K (S_TG 6,113 against 4,584 tok/s); q4_k 4.013 and 3.334 against 3.940 (32/256/2/3 3.794, 128/128/4/3
4.097, 16/256/2/3 5.381, 64/128/8/3 5.549); q4_k_m 4.012 and 3.461 against 4.129 (the tile was then every kind's).

Through bf16's bits (chapter 09's `_int8_as_bf16`, `_nibbles_as_bf16`) and the int8 launches at eight programs an SM,
one H100, one machine (the graph, S_TG): Q8_0 planes 3.133 ms (4,981 tok/s) with the fp32 path at four an SM, 3.046
(5,092) through the bits, **2.865 (5,330)** with int8 at eight (`programs=8`), the fp32 path at eight 2.955 (5,289),
the bits at sixteen 3.457, the fp32 path at two 3.338; Q4_K planes 3.293 (4,690) before, 3.095-3.102 (5,046-5,098)
through the bits, int4 at eight 3.625.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 kernels_lab/sixteen_seqs_step.py [export,head_split,split,swap,folded,dependent=16,tile=32/256/2/3]"""

import os
import sys

import torch

from decode_step_timeline import decode_graph, kernel_events, print_kernels, replay_ms, set_constant
from forge_engine.bench import free_memory, random_prompts, run_batch
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.quant.gguf_gpu import ConcatLinear, Int8GroupLinear
from forge_engine.quant.layers import Int4Linear, QuantEmbedding, swap_layer_matrices

GROUP = 32


def random_planes(n: int, k: int, device) -> Int8GroupLinear:
    "A Q8_0 matrix as the loader repacks it: int8 [n, k] and an fp16 scale per 32 inputs, random."
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    scale = (torch.rand(n, k // GROUP, device=device) * 2e-3 + 1e-3).half()
    return Int8GroupLinear(q, scale)


def random_int4_planes(n: int, k: int, device) -> Int4Linear:
    "A Q4_K matrix as the loader repacks it: chapter 10's int4 nibbles and an fp16 scale and minimum per 32, random."
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scale = (torch.rand(n, k // GROUP, device=device) * 2e-3 + 1e-3).half()
    return Int4Linear.from_groups(packed, scale, (-8 * scale.float()).half())


def q8_0_model():
    """random:qwen3-4b with every matrix, and the tied head, as random Q8_0 planes; LAB_PLANES=q4_k: the layers' matrices
    as random Q4_K planes (a Q4_K_M file's but for its Q6_K v and down in some layers), the head Q8_0; LAB_PLANES=q4_k_m:
    those, with every other layer's v rows (qkv a ConcatLinear) and down as int8 planes, as Q6_K repacks; LAB_PLANES=int4:
    random:qwen3-4b quantized to int4 by the loader (`--quantization int4`, groups of 128)."""
    kind = os.environ.get("LAB_PLANES", "q8_0")
    if (
        kind == "int4"
    ):  # --quantization int4 as the loader makes it (groups of 128), no planes swapped in
        return load_model("random:qwen3-4b", "cuda", progress=False, quantization="int4")
    loaded = load_model("random:qwen3-4b", "cuda", progress=False, quantization="int8")
    model = loaded.model
    planes = random_planes if kind == "q8_0" else random_int4_planes
    v_rows = model.config.num_kv_heads * model.config.head_dim

    def swap(m, where):
        (n, k), device = m.qweight.shape, m.qweight.device
        layer = int(where.split()[1])
        if (
            kind != "q4_k_m" or layer % 2
        ):  # q4_k_m: every other layer's v and down as Q6_K (int8 planes)
            return planes(n, k, device)
        if where.endswith("down"):
            return random_planes(n, k, device)
        if where.endswith("qkv"):
            return ConcatLinear(
                [random_int4_planes(n - v_rows, k, device), random_planes(v_rows, k, device)]
            )
        return planes(n, k, device)

    swap_layer_matrices(model, swap)
    model.lm_head = random_planes(*model.lm_head.qweight.shape, model.lm_head.qweight.device)
    model.embed = QuantEmbedding(model.lm_head, torch.bfloat16)
    torch.cuda.empty_cache()
    return loaded


def sixteen(engine) -> dict:
    "S_TG at 16 sequences and the decode rate of one, as llama_cpp_cuda_peer.py counts them."
    result = {}
    for seqs in (16, 1):
        prompts = random_prompts(seqs, 128, 128, seed=200)
        run_batch(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        walls = {}
        for new in (1, 129):
            fresh = [[(t + new) % 10000 for t in p] for p in prompts]
            walls[new] = run_batch(
                engine, fresh, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            )["wall_s"]
        result[seqs] = seqs * 128 / (walls[129] - walls[1])
    return result


def use_swap(config):
    from sixteen_rows_swap import int8_group_swap

    plain = Int8GroupLinear.skinny

    def skinny(self, x):
        if 4 < x.shape[0] <= 16:
            return int8_group_swap(x, self.qweight, self.scale, *config)
        return plain(self, x)

    Int8GroupLinear.skinny = skinny


def use_folded(tile, int8_dot=False):
    """Steps of up to 16 rows through folded_rows_matmul.py's kernel with the norms handed off between the layers'
    matrices (chapter 09a's hand-off path, as it takes chapter 10's int4 GEMV): Int8GroupLinear given a
    `decode_gemv` that folds them, for steps of 1-16 rows. int8_dot: x quantized to int8, int8 products
    (`folded_int8`)."""
    from folded_rows_matmul import folded_rows_matmul

    def decode_gemv(
        self, x, swiglu=False, residual=None, eps=1e-6, norm_sums=None, hand_off=None, tickets=None
    ):
        return folded_rows_matmul(
            x, self.qweight, scale=self.scale, swiglu=swiglu, residual=residual, norm_sums=norm_sums,
            hand_off=hand_off, eps=eps, tile=tile, int8_dot=int8_dot,
        )  # fmt: skip

    Int8GroupLinear.decode_gemv = decode_gemv
    Int8GroupLinear.takes_decode_step = lambda self, x: x.shape[0] <= 16  # one sequence's steps too


def use_folded_int4(tile):
    """Steps of 2-16 rows on chapter 10's int4 planes (LAB_PLANES=q4_k) through folded_rows_matmul.py's kernel, the norms
    handed off between the matrices; one row keeps chapter 10's int4 GEMV, as exported."""
    from folded_rows_matmul import folded_rows_matmul

    one_row = Int4Linear.decode_gemv

    def decode_gemv(self, x, tickets=None, **folds):
        if x.shape[0] == 1:
            return one_row(self, x, **folds)
        return folded_rows_matmul(
            x, self.qweight, int4_pairs=self.scale_minimum, tile=tile, **folds
        )

    Int4Linear.decode_gemv = decode_gemv
    Int4Linear.takes_decode_step = lambda self, x: x.shape[0] <= 16


def rows_on_split_k(head_only: bool):
    """Calls of 5-16 rows on int8 planes through chapter 10g's split-K, as before chapter 09's rows_matmul took them:
    the LM head's (head_only), or those and the layers' decode steps (their norms then separate kernels; int4 planes'
    steps of 2-16 rows through chapter 10's split-K too)."""
    import forge_engine.quant.gguf_gpu as gguf_gpu
    import forge_engine.quant.layers as quant_layers

    if (
        not head_only
    ):  # (takes_decode_step and int8_group_matmul both ask it; Int4Linear.takes_decode_step too)
        gguf_gpu.fits_rows_matmul = lambda x, group=0: False
        quant_layers.fits_rows_matmul = lambda x, group=0: False
        return
    plain, fits = Int8GroupLinear.skinny, gguf_gpu.fits_rows_matmul

    def skinny(self, x):  # (the layers' decode steps go through decode_gemv, not here)
        gguf_gpu.fits_rows_matmul = lambda x, group=0: False
        try:
            return plain(self, x)
        finally:
            gguf_gpu.fits_rows_matmul = fits

    Int8GroupLinear.skinny = skinny


def main():
    variants = (sys.argv[1] if len(sys.argv) > 1 else "export,swap").split(",")
    swap_config = tuple(int(v) for v in os.environ.get("LAB_SWAP", "128,128,4,3,2").split(","))
    folded_tile = tuple(int(v) for v in os.environ.get("LAB_FOLDED", "64,128,4,3").split(","))
    for variant in variants:
        if variant in ("split", "head_split"):
            rows_on_split_k(head_only=variant == "head_split")
        if variant == "swap":
            use_swap(swap_config)
        if variant in ("folded", "folded_int8"):
            use_folded(folded_tile, int8_dot=variant == "folded_int8")
        if variant == "folded4":
            use_folded_int4(folded_tile)
        # tile=BLOCK_N/BLOCK_K/warps/stages: chapter 09's rows_matmul in that tile (tile4=: its int4 tile)
        if variant.startswith(("tile=", "tile4=")):
            import forge_engine.kernels.rows_matmul as rows_matmul

            name = "ROWS_MATMUL_INT4_TILE" if variant.startswith("tile4=") else "ROWS_MATMUL_TILE"
            setattr(rows_matmul, name, tuple(int(v) for v in variant.split("=")[1].split("/")))
        # programs=N: every rows_matmul launch aims for N programs an SM (split along K), whatever its kind's default
        elif variant.startswith("programs="):
            import forge_engine.kernels.rows_matmul as rows_matmul

            per_sm = int(variant.split("=")[1])
            rows_matmul.split_k_programs = lambda device, _kind_default=4: (
                per_sm * torch.cuda.get_device_properties(device).multi_processor_count
            )
        # dependent=N: the step's small kernels launched as dependents up to N rows; NAME=N: a kernel constant
        elif "=" in variant:
            name, value = variant.split("=")
            set_constant("DEPENDENT_LAUNCH_MAX_ROWS" if name == "dependent" else name, int(value))
        engine = LLMEngine(q8_0_model(), EngineConfig(max_num_seqs=16, max_num_batched_tokens=8192))
        rates = sixteen(engine)
        print(
            f"[{variant}] S_TG 16 sequences {rates[16]:7.1f} tok/s; 1 sequence {rates[1]:6.1f} tok/s",
            flush=True,
        )
        graph = decode_graph(engine, 16, 128)
        print(f"[{variant}] 16-row decode graph {replay_ms(graph):.3f} ms a replay")
        print_kernels(kernel_events(graph), top=12)
        del engine, graph
        free_memory()


if __name__ == "__main__":
    main()
