"""What may overlap between the kernels of a decode step, and does it pay? Chapter 09's tuning constants and chapter
10's int4 settings, each measured here in the decode step against the defaults, and two folds of chapter 09a turned off
by lab code ("norms not folded", "norms not handed off").

What the measurements decided. The winners are the package's only code now (chapters 09_kernels_* and 09a): the
decode attention stores the step's new K/V itself (one launch fewer a layer), walks a split's tiles, the partial last
one too, in one masked loop, applies q/k-norm and RoPE to q and the new K (no norm_rope launch), merges its splits in
the last split to finish, with the split length from the batch's size (64-key splits at batch 1, DECODE_MIN_SPLIT);
the gate-up GEMV applies SiLU-mul in its epilogue (no silu_mul launch); the BF16 gate-up and (GEMV_ROWS_INT8_MIN_N)
int8 gate-up run `_gemv_rows_kernel`; the small kernels and the decode attention are launched as programmatic
dependents in steps of at most DEPENDENT_LAUNCH_MAX_ROWS rows, the attention asking for its first K/V tile before it
waits for q; every GEMV asks for its first weights before it waits (`early_weights`); a batch-1 step's add + RMSNorm
is folded into the BF16 GEMVs around it and handed from GEMV to GEMV for int8 and int4; the merging program's loop is
unrolled (DECODE_UNROLL_MERGE).

Measured and lost, and no longer in the package (each was a module switch; this lab compared them):
- the GEMVs asking for their weights into L2 before the input wait (one `cp.async.bulk.prefetch` a warp in
  `_start_gemv`), for every GEMV, for the o projection only, or o and qkv: the BF16 step 3.326 ms against 2.851, int4
  2.476 against 2.370 (only int4 with the small kernels launched as dependents as well gained, 2.272; a per-format
  choice would have had to reach the small kernels too); the int4 gate-up / down alone lost as well;
- the GEMV loops software-pipelined by Triton (2-3 stages: later steps' loads in flight through shared memory): the
  BF16 step 2.883 ms at 3 stages against 2.851, int4's chain 40-70% slower;
- the rows layout for the LM head too: no difference;
- int8 qkv / gate-up in the rows kernel with offset bytes (1.815 ms against 1.780); int8 qkv through the rows kernel
  too, o and down through it (2 rows, 4 warps, 4,096 inputs a step: a program's whole row asked for before the wait:
  1.796 ms against 1.682); the int8 tile GEMVs summing each thread's 8 inputs every step (40 registers instead of 96;
  1.907 against 1.679); int8 read as 2^15 + 128 + w (one permute a weight, x's sum off at the end) and the int8 norm
  fold with its own tiles; each step's weights loaded a step ahead in registers.

For each weight format (bf16; int8 and int4 quantized, chapter 10):
1. validation: the first weights asked for early (and, int4, more steps of them) give the same outputs as the plain
   GEMV (no arithmetic changes);
2. the chain lab's 36 GEMVs of one Qwen3-4B shape in one CUDA graph (gemv_chain_sweep.py): without programmatic
   dependent launch, with it, with the first weights after the wait;
3. random:qwen3-4b's batch-1 decode step (its CUDA graph replayed alone) and one W1-like request (128-token prompt,
   256 greedy tokens: decode tok/s) under the settings of SWITCHES (each from the defaults), in one process
   (the settings are read when a graph is captured).

Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/decode_overlap.py [bf16,int8,int4]"""

import gc
import itertools
import os
import sys

from common import (
    DEVICE,
    ON_GPU,
    finish,
    graphed_ms,
    selected,
)  # first: it may switch on the interpreter
import torch
from forge_engine.kernels import backend, paged_attention
from forge_engine.kernels import gemv as kernels_gemv
import forge_engine.fused_layers as fused_layers
from forge_engine.fused_layers import FusedRMSNorm
import forge_engine.quant.gemv as quant  # the int4 GEMV (chapter 10c): its switches, tiles and launch
import forge_engine.quant.layers as quant_layers
from forge_engine.bench import free_memory, random_prompts, run_batch
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from decode_step_timeline import decode_graph, replay_ms
from gemv_chain_sweep import LAYERS, SHAPES, product, weights
from int4_head import int4_head

if not ON_GPU:
    sys.exit("needs a GPU: the decode step's graph and dependent launches (sm_90)")


def validate(formats) -> bool:
    ok = True
    for fmt, (n, k) in itertools.product(
        formats, ((96, 512), (40, 1024), (2560, 4096), (512, 2560), (256, 9728))
    ):
        w, x = weights(fmt, n, k), torch.randn(1, k, device=DEVICE).bfloat16()
        plain = product(fmt, x, w, early_weights=False)
        more = (
            (dict(early_weights=2), dict(early_weights=3)) if fmt == "int4" else ()
        )  # (int4: steps before the wait)
        for launch in (dict(early_weights=True), *more):
            same = torch.equal(plain, product(fmt, x, w, **launch))
            print(f"  {fmt} N={n} K={k} {launch}: the same as without: {same}")
            ok &= same
    return ok


def chain(formats):
    print(
        f"\n== {LAYERS} GEMVs of one shape, distinct weights, one CUDA-graph replay (µs a matrix)"
    )
    for fmt, (label, (n, k)) in itertools.product(formats, SHAPES.items()):
        layers = [weights(fmt, n, k) for _ in range(LAYERS)]
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        variants = {
            "no PDL": dict(pdl=False),
            "PDL": {},
            "first weights late": dict(early_weights=False),
        }
        times = {}
        for name, launch in [
            *variants.items(),
            *variants.items(),
        ]:  # two rounds: the second one counts
            times[name] = (
                graphed_ms(lambda: [product(fmt, x, w, **launch) for w in layers]) * 1e3 / LAYERS
            )
        print(
            f"  {fmt:5s} {label:8s} " + "  ".join(f"{name} {t:6.2f}" for name, t in times.items()),
            flush=True,
        )
        layers = None  # (freed; not `del`: the lambdas above name it)
        torch.cuda.empty_cache()


def decode_step_ms(engine) -> float:
    "One batch-1 decode graph (128-token prompt) replayed alone, ms a replay; the request then runs to its end."
    step = replay_ms(decode_graph(engine, prompt_tokens=128, max_tokens=24))
    while engine.has_unfinished():
        engine.step()
    return step


KERNELS = (
    backend,
    kernels_gemv,
    paged_attention,
)  # chapter 09's modules, holding its tuning constants


def owner(name: str):
    "The module of a switch: one of chapter 09's, else chapter 10's int4 GEMV."
    return next((m for m in KERNELS if hasattr(m, name)), quant)


DEFAULTS = {
    name: getattr(owner(name), name)
    for name in (
        "DECODE_BLOCK_N",
        "DEPENDENT_LAUNCH_MAX_ROWS",
        "GEMV_ROWS_MAX_N",
        "GEMV_ROWS_INT8_MIN_N",
        "DECODE_MIN_SPLIT",
        "DECODE_UNROLL_MERGE",
    )
}
DEFAULTS["INT4_EARLY_WEIGHTS"] = quant.INT4_EARLY_WEIGHTS
DEFAULTS["INT4_EARLY_EPILOGUE"] = quant.INT4_EARLY_EPILOGUE
DEFAULTS["INT4_INT_DOT"] = quant.INT4_INT_DOT
DEFAULTS["INT4_TILE_MAXNREG"] = quant.INT4_TILE_MAXNREG
EXPORTED_FOLDS = (
    fused_layers.gemv_folds_norms,
    fused_layers.gemv_hands_off_norms,
    quant_layers.gemv_hands_off_norms,
)


EXPORTED_ADD_NORM = FusedRMSNorm.add_and_norm
EXPORTED_CONFIG = kernels_gemv.gemv_config
EXPORTED_INT4_CONFIG = quant.quant_gemv_config
EXPORTED_INT4_GEMV = quant.int4_gemv


def configs_for(configs: dict):
    "gemv_config with `configs` ({(n, k, weight bytes, layout): (BLOCK_N, BLOCK_K, warps)}) in place of its answers."

    def gemv_config(n, k, weight_bytes=2, layout=None, rows=1):
        chosen = layout or kernels_gemv.gemv_layout(n, k, weight_bytes, rows)
        return configs.get((n, k, weight_bytes, chosen)) or EXPORTED_CONFIG(
            n, k, weight_bytes, layout, rows
        )

    return gemv_config


# int8 tiles tried in the decode step (the sweeps chose them in a chain of one shape, without the norms' hand-off)
INT8_SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "down": (2560, 9728), "head": (151936, 2560)}
INT8_TILES = {
    "qkv": ((8, 512, 2), (8, 512, 4), (4, 512, 2)),
    "o": ((2, 2048, 4), (4, 1024, 4), (8, 512, 4)),
    "down": ((4, 1024, 4), (8, 512, 4), (4, 512, 2)),
    "head": (
        (4, 512, 2),
        (8, 1024, 4),
        (2, 512, 2),
        (4, 256, 1),
        (4, 512, 1),
        (8, 256, 1),
        (2, 1024, 4),
        (8, 512, 4),
    ),
}


# int4 tiles tried in the decode step (the chain's winners, and more rows a program: the gate-up's 8 rows won here)
INT4_SHAPES = {
    "qkv": (6144, 2560),
    "o": (2560, 4096),
    "gate-up": (19456, 2560),
    "down": (2560, 9728),
}
INT4_TILES = {
    "qkv": ((8, 1, 8), (8, 2, 8), (4, 1, 8), (2, 1, 8)),
    "o": ((8, 4, 16), (2, 4, 16), (4, 2, 16), (4, 8, 16)),
    "gate-up": ((6, 1, 8), (6, 2, 8), (6, 1, 16), (4, 1, 8), (16, 1, 8), (8, 2, 8)),
    "down": ((8, 4, 16), (2, 4, 16), (4, 8, 16), (2, 8, 16)),
}

# register caps on the int4 tiles, in the step. In FP32: qkv 56, o 64, down 64 (they spill) and gate-up 104 slower,
# gate-up 96 faster (chapter 10's INT4_TILE_MAXNREG); caps that spill nothing or little offline, qkv 64, o 80, gate-up
# 88, down 80, all slower. In integers (fewer registers; offline, with the step's folds and early steps, no spills at
# any of these): qkv 72 (28 warps an SM against 24 at 80) and 64 (63 registers, 32), o 64 (32 against 28), gate-up 80
# (80 registers, 25 warps: under its cap of 96 ptxas takes 95, 21 warps; uncapped it takes 80 too), down 80 (24
# against 20): o at 80 faster, at 96 faster still (chapter 10's cap), the rest slower
INT4_CAPS = {"qkv": (64, 72), "o": (64, 80, 96), "gate-up": (80, 88), "down": (80,)}
# more of a program's steps of weights asked for before its wait (`early_weights`; qkv and down have
# three steps a row, o one; the gate-up's five spill under its cap of 96 from two on: also tried uncapped, maxnreg 0)
INT4_EARLY = {
    "qkv": ((2, None), (3, None)),
    "down": ((2, None), (3, None)),
    "gate-up": ((2, 0), (3, 0), (1, 0)),
}


def int4_gemv_for(launches: dict):
    "int4_gemv with other launch settings for some weight shapes ({(n, k): {maxnreg: ..., ...}}; lab-only)."

    def int4_gemv(x, packed, *args, **kwargs):
        for name, value in launches.get((packed.shape[0], 2 * packed.shape[1]), {}).items():
            kwargs.setdefault(name, value)
        return EXPORTED_INT4_GEMV(x, packed, *args, **kwargs)

    return int4_gemv


def skipped_add_norm(self, x, residual):
    "A lab-only bound: the add + RMSNorm's launch gone (x returned as the normalised input and the residual)."
    return x, residual


def no_folds(weight, rows=1):
    "Lab-only: a decode step's norms neither folded into nor handed between the GEMVs (their separate launches)."
    return False


SWITCHES = {  # name: chapter 09's tuning constants (and chapter 10's int4 settings) that differ from their defaults
    "defaults": {},
    "early weights, int4 too": dict(INT4_EARLY_WEIGHTS=True),
    "decode splits of 128 and up": dict(DECODE_MIN_SPLIT=128),
    "decode splits of 256 and up": dict(DECODE_MIN_SPLIT=256),
    "one decode split": dict(DECODE_MIN_SPLIT=1 << 20),
    "decode tiles of 64": dict(DECODE_BLOCK_N=64),
    "decode splits of 32": dict(DECODE_MIN_SPLIT=32),
    "rows layout for the LM head too": dict(GEMV_ROWS_MAX_N=1 << 30),
    "norms not folded, not handed off": dict(NO_NORM_FOLDS=True),
    "int8 tile gate-up": dict(GEMV_ROWS_INT8_MIN_N=1 << 30),
    "int8 rows, qkv and gate-up": dict(GEMV_ROWS_INT8_MIN_N=0),
    # what the add + RMSNorm launches between the quantized GEMVs cost at most (wrong values: the GEMVs
    # read the un-normalised sum; the layers' add + norm return it unchanged, no launch)
    "add+norm launches skipped (a bound)": dict(SKIP_ADD_NORMS=True),
    # int4's epilogue operands (residual, norm weights) loaded after the loop
    "int4 epilogue operands late": dict(INT4_EARLY_EPILOGUE=False),
    **{
        f"int8 {name} {'x'.join(map(str, tile))}": dict(
            GEMV_CONFIGS={(*INT8_SHAPES[name], 1, "tile"): tile}
        )
        for name, tiles in INT8_TILES.items()
        for tile in tiles
    },
    # the merging program's loop over the splits not unrolled (one split's loads a trip)
    "merge split by split": dict(DECODE_UNROLL_MERGE=0),
    # int4 tiles in the decode step ((BLOCK_N, warps, chunk bytes); gate-up: 8 rows measured faster)
    **{
        f"int4 {name} {'x'.join(map(str, tile))}": dict(INT4_CONFIGS={INT4_SHAPES[name]: tile})
        for name, tiles in INT4_TILES.items()
        for tile in tiles
    },
    # ... and the exported tiles under a register cap (`int4_gemv`'s maxnreg; offline: the gate-up's 8 x 1 x 8 at 96
    # registers spills nothing, 21 warps an SM instead of 16)
    **{
        f"int4 {name} maxnreg {cap}": dict(INT4_LAUNCH={INT4_SHAPES[name]: dict(maxnreg=cap)})
        for name, caps in INT4_CAPS.items()
        for cap in caps
    },
    # the lower caps together (qkv at 72 or 64; o 64, gate-up 80, down 80): 1.281 / 1.324 ms, slower
    **{
        f"int4 caps {qkv}/64/80/80": dict(
            INT4_LAUNCH={
                INT4_SHAPES["qkv"]: dict(maxnreg=qkv),
                INT4_SHAPES["o"]: dict(maxnreg=64),
                INT4_SHAPES["gate-up"]: dict(maxnreg=80),
                INT4_SHAPES["down"]: dict(maxnreg=80),
            }
        )
        for qkv in (72, 64)
    },
    # more steps of weights before the wait (maxnreg None: chapter 10's cap; 0: none)
    **{
        f"int4 {name} early {steps}" + (" uncapped" if cap == 0 else ""): dict(
            INT4_LAUNCH={INT4_SHAPES[name]: dict(early_weights=steps, maxnreg=cap)}
        )
        for name, settings in INT4_EARLY.items()
        for steps, cap in settings
    },
    "int4 qkv and down early 3": dict(
        INT4_LAUNCH={
            INT4_SHAPES["qkv"]: dict(early_weights=3),
            INT4_SHAPES["down"]: dict(early_weights=3),
        }
    ),
    "int4 qkv early 3, down early 2": dict(
        INT4_LAUNCH={
            INT4_SHAPES["qkv"]: dict(early_weights=3),
            INT4_SHAPES["down"]: dict(early_weights=2),
        }
    ),
    "int4 tiles uncapped": dict(INT4_TILE_MAXNREG={}),  # chapter 10's register caps off
    # the int4 GEMV's arithmetic in FP32 (chapter 10's `INT4_INT_DOT` off); qkv's 4 x 2 x 8 in integers
    # under a cap (uncapped, ptxas takes 72 registers and spills six values around the early steps; at 80, 78, none)
    "int4 floats": dict(INT4_INT_DOT=False),
    "int4 qkv integers maxnreg 80": dict(INT4_LAUNCH={INT4_SHAPES["qkv"]: dict(maxnreg=80)}),
    "int4 qkv integers maxnreg 96": dict(INT4_LAUNCH={INT4_SHAPES["qkv"]: dict(maxnreg=96)}),
    # offline, with the step's folds: the gate-up in integers uncapped (64 registers,
    # 32 warps an SM, against 80 and 25 under FP32's cap of 96), or with two early steps (96, no spills); o in FP32
    # (slower in integers in the chain: 3.88 against 3.73 µs)
    "int4 gate-up integers uncapped": dict(INT4_LAUNCH={INT4_SHAPES["gate-up"]: dict(maxnreg=0)}),
    "int4 gate-up integers early 2": dict(
        INT4_LAUNCH={INT4_SHAPES["gate-up"]: dict(early_weights=2)}
    ),
    "int4 o floats": dict(INT4_LAUNCH={INT4_SHAPES["o"]: dict(int_dot=False)}),
    # the integer tiles and early steps in the step: o's 4 x 2 x 16 and the gate-up's two early steps each faster
    # alone, together 1.225 ms against 1.252 / 1.247 (chapter 10's tiles); the LM head in int4 (lab-only: the int8
    # head re-quantized, its embedding tied to it): 1.234 ms, 18 µs for more error, not taken. (Each loop step's
    # weights asked for a step ahead, registers double-buffered, lost too: the gate-up 1.254 / 1.267 uncapped / 1.239
    # with two early steps, down 1.349; not in chapter 10.)
    "int4 o 4x2x16, gate-up early 2": dict(
        INT4_CONFIGS={INT4_SHAPES["o"]: (4, 2, 16)},
        INT4_LAUNCH={INT4_SHAPES["gate-up"]: dict(early_weights=2)},
    ),
    "int4 o 4x2x16 early 2, gate-up early 2": dict(
        INT4_CONFIGS={INT4_SHAPES["o"]: (4, 2, 16)},
        INT4_LAUNCH={
            INT4_SHAPES["gate-up"]: dict(early_weights=2),
            INT4_SHAPES["o"]: dict(early_weights=2),
        },
    ),
    "int4 head": dict(INT4_HEAD=True),
    "int4 head, o 4x2x16, gate-up early 2": dict(
        INT4_HEAD=True,
        INT4_CONFIGS={INT4_SHAPES["o"]: (4, 2, 16)},
        INT4_LAUNCH={INT4_SHAPES["gate-up"]: dict(early_weights=2)},
    ),
    "defaults again": {},
}


def switch(**changes):
    "Chapter 09's tuning constants (and chapter 10's int4 settings): their defaults, with `changes`."
    folds = (
        (no_folds,) * 3 if changes.pop("NO_NORM_FOLDS", False) else EXPORTED_FOLDS
    )  # (lab-only: read at capture)
    (
        fused_layers.gemv_folds_norms,
        fused_layers.gemv_hands_off_norms,
        quant_layers.gemv_hands_off_norms,
    ) = folds
    FusedRMSNorm.add_and_norm = (
        skipped_add_norm if changes.pop("SKIP_ADD_NORMS", False) else EXPORTED_ADD_NORM
    )
    configs = changes.pop("GEMV_CONFIGS", None)  # (lab-only: other tiles for some shapes)
    kernels_gemv.gemv_config = configs_for(configs) if configs else EXPORTED_CONFIG
    int4_configs = changes.pop(
        "INT4_CONFIGS", {}
    )  # (lab-only: other int4 tiles, {(n, k): (BLOCK_N, warps, chunk)})
    quant.quant_gemv_config = lambda n, k: int4_configs.get((n, k)) or EXPORTED_INT4_CONFIG(n, k)
    int4_launch = changes.pop(
        "INT4_LAUNCH", None
    )  # (lab-only: register caps, early steps for some int4 shapes)
    quant.int4_gemv = quant_layers.int4_gemv = (
        int4_gemv_for(int4_launch) if int4_launch else EXPORTED_INT4_GEMV
    )
    for name, value in dict(DEFAULTS, **changes).items():
        setattr(owner(name), name, value)


def w1_decode_tok_s(engine, new_tokens: int = 256) -> float:
    "One W1 request (the bench's prompt: 128 random ids, seed 1): decode tokens a second after the first token."
    prompt = random_prompts(1, 128, 128, seed=1)[0]
    run_batch(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )  # warm-up
    r = run_batch(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    )
    return (new_tokens - 1) / (r["wall_s"] - r["ttft_median_s"])


def engine_runs(formats):
    print(
        "\n== random:qwen3-4b: batch-1 decode graph replay, W1-like decode tok/s (one engine a setting, max_num_seqs 8)"
    )
    for fmt in formats:
        loaded = load_model(
            "random:qwen3-4b", "cuda", progress=False, quantization="none" if fmt == "bf16" else fmt
        )
        int8_head = (loaded.model.lm_head, loaded.model.embed)
        for name, setting in selected(SWITCHES).items():  # $LAB_VARIANTS: some of them, by name
            setting = dict(setting)
            if setting.pop("INT4_HEAD", False):
                int4_head(loaded.model)
            switch(**setting)
            engine = LLMEngine(loaded, EngineConfig(max_num_seqs=8))
            step = decode_step_ms(engine)
            print(
                f"  {fmt:5s} {name:31s}: step graph {step:.3f} ms, W1 {w1_decode_tok_s(engine):.1f} tok/s",
                flush=True,
            )
            del engine
            loaded.model.lm_head, loaded.model.embed = int8_head
            free_memory()
        switch()
        del loaded
        gc.collect()
        torch.cuda.empty_cache()


def main():
    formats = (sys.argv[1] if len(sys.argv) > 1 else "bf16,int8,int4").split(",")
    ok = validate(formats)
    if not os.environ.get("LAB_NO_CHAIN"):
        chain(formats)
    engine_runs(formats)
    finish(ok)


if __name__ == "__main__":
    main()
