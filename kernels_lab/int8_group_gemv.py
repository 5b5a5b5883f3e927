"""Chapter 10g's int8 GEMV with fp16 group scales (the planes a GGUF file's Q8_0 and Q6_K blocks repack into at load)
against chapter 10d's GGUF GEMV on the blocks as the file has them, and chapter 09's int8 GEMV with one scale a row
(the same bytes less the scales: what the layout can reach). One row, Qwen3-4B's matrices and its Q6_K LM head,
CUDA-graph replays with L2 flushed, a sweep of chapter 10g's tiles (BLOCK_N, warps, CHUNK); then 16 rows (the
split-K launch) and 512 (dense) against the GGUF kernels at the same rows.

Napkin math: Q8_0 is 8.5 bits a weight and so are its planes (8 + 16 / 32); Q6_K's planes are 9 (8 + 16 / 16).
gate_up in Q8_0 (19,456 x 2,560, 52.9 MB) at the H200's ~4.2 TB/s read ceiling: 12.6 us.

Run on the GPU machine from the repository root: PYTHONPATH=. python3 kernels_lab/int8_group_gemv.py"""

from common import (
    DEVICE,
    ON_GPU,
    finish,
    time_variant,
    validate,
)  # first: may switch on the interpreter
import torch

from forge_engine.kernels.gemv import gemv
from forge_engine.quant.gguf_blocks import gguf_bytes, gguf_matmul, gguf_matmul_reference
from forge_engine.quant.split_k import _skinny_matmul
from forge_engine.quant.gguf_gpu import (
    _int8_group_matmul_kernel,
    int8_group_gemv,
    int8_group_gemv_config,
    int8_group_matmul,
    q6_k_as_int8,
    q8_0_as_int8,
)

SHAPES = {  # name: (GGML type, n, k)
    "qkv Q8_0": (8, 6144, 2560),
    "o Q8_0": (8, 2560, 4096),
    "gate_up Q8_0": (8, 19456, 2560),
    "down Q8_0": (8, 2560, 9728),
    "v Q6_K": (14, 1024, 2560),
    "down Q6_K": (14, 2560, 9728),
    "head Q6_K": (14, 151936, 2560),
}
CONFIGS = [(bn, w, c) for bn in (1, 2, 4, 8) for w in (1, 2, 4) for c in (8, 16)]
REPACK = {8: q8_0_as_int8, 14: q6_k_as_int8}

ok = True
torch.manual_seed(0)
for name, (qtype, n, k) in SHAPES.items():
    if not ON_GPU:  # the interpreter: one small shape checks the arithmetic
        n, k = 64, 512
    raw = gguf_bytes(qtype, n, k).to(DEVICE)
    q, scale = REPACK[qtype](raw)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    want = gguf_matmul_reference(x.float(), raw, qtype)
    ok &= validate(f"{name} int8 group GEMV", int8_group_gemv(x, q, scale).float(), want, 1e-2)
    if not ON_GPU:
        break
    planes = q.numel() + 2 * scale.numel()
    row_scale = torch.rand(n, device=DEVICE)
    for label, fn, nbytes in (
        ("gguf GEMV (10d)", lambda: gguf_matmul(x, raw, qtype, impl="triton"), raw.numel()),
        ("int8, a scale a row (09)", lambda: gemv(x, q, None, row_scale, impl="triton"), q.numel()),
    ):
        ms, how = time_variant(fn, graph=True)
        print(f"  {name:12s} {label:26s} {ms * 1e3:7.1f} us  {nbytes / ms / 1e9:5.2f} TB/s")
    results = []
    for config in CONFIGS:
        try:
            ms, _ = time_variant(lambda: int8_group_gemv(x, q, scale, config), graph=True)
        except Exception as e:  # a tile the compiler refuses: say so, go on
            print(f"  {name:12s} {config}: {type(e).__name__} {str(e)[:80]}")
            continue
        results.append((ms, config))
    results.sort()
    rule = int8_group_gemv_config(n, k)
    rule_ms = next((ms for ms, c in results if c == rule), float("nan"))
    for ms, config in results[:4]:
        print(
            f"  {name:12s} int8 group {str(config):14s} {ms * 1e3:7.1f} us  {planes / ms / 1e9:5.2f} TB/s"
        )
    print(
        f"  {name:12s} the rule's {str(rule):14s} {rule_ms * 1e3:7.1f} us  {planes / rule_ms / 1e9:5.2f} TB/s"
    )
    for rows in (16, 512):
        xm = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
        ok &= validate(
            f"{name} {rows} rows",
            int8_group_matmul(xm, q, scale).float()
            if rows <= 16
            else (
                xm
                @ (q.float() * scale.float().repeat_interleave(k // scale.shape[1], 1)).T.to(
                    xm.dtype
                )
            ).float(),
            gguf_matmul_reference(xm.float(), raw, qtype),
            2e-2,
        )
        from forge_engine.quant.gguf_gpu import Int8GroupLinear

        layer = Int8GroupLinear(q, scale)
        ours = (lambda: layer.skinny(xm)) if rows <= 16 else (lambda: layer.dense(xm))
        tiled = lambda: _skinny_matmul(  # noqa: E731
            _int8_group_matmul_kernel,
            xm,
            (q, scale),
            n,
            64,
            BLOCK_K=64,
            GROUP=k // scale.shape[1],
            block_n=128,
        )
        for label, fn in (
            ("gguf (10d)", lambda: gguf_matmul(xm, raw, qtype, impl="triton")),
            ("int8 group", ours),
            ("split-K dot", tiled),
        ):
            ms, _ = time_variant(fn, graph=True)
            print(f"  {name:12s} {rows:3d} rows {label:12s} {ms * 1e3:8.1f} us")
finish(ok)
