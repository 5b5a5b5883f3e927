"""What each launcher passes its kernels: the constexprs and launch options of the default launches at Qwen3-4B's shapes
(gemv in BF16 and int8 with the decode step's folds, int4_gemv, decode attention at 1 / 8 / 64 sequences with and
without the step's K/V, prefill, the small kernels), recorded on a CPU with every kernel replaced by a recorder and
programmatic dependent launch forced on, as on an H200. `codegen_snapshot.py` compiles given constexprs; this checks
that the launchers still choose the same ones. Constexprs a change removed (`DROPPED`) are left out of the record.

    PYTHONPATH=. python3 kernels_lab/launch_snapshot.py /tmp/launches_after.json   (and at the old commit: before)
    python3 -c "import json; a, b = (json.load(open(p)) for p in ('/tmp/launches_before.json', '/tmp/launches_after.json')); print(a == b)"
"""

import importlib, json, sys
import torch

MODS = [
    "forge_engine.kernels",
    "forge_engine.kernels.backend",
    "forge_engine.kernels.elementwise",
    "forge_engine.kernels.gemv",
    "forge_engine.kernels.paged_attention",
    "forge_engine.kernels.prefill_attention",
    "forge_engine.quant.gemv",
]
mods = []
for m in MODS:
    try:
        mods.append(importlib.import_module(m))
    except ImportError:
        pass
records = []


class Recorder:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kw):
            records.append(
                (
                    self.name,
                    {
                        k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                        for k, v in kw.items()
                    },
                )
            )

        return launch


KERNELS = [
    "_gemv_kernel",
    "_gemv_rows_kernel",
    "_decode_kernel",
    "_merge_splits_kernel",
    "_prefill_kernel",
    "_add_rmsnorm_kernel",
    "_norm_rope_kernel",
    "_silu_mul_kernel",
    "_write_kv_kernel",
    "_int4_gemv_kernel",
]
for mod in mods:
    for k in KERNELS:
        if hasattr(mod, k):
            setattr(mod, k, Recorder(k))
    if hasattr(mod, "pdl_supported"):
        setattr(mod, "pdl_supported", lambda device: True)
    if hasattr(mod, "INTERPRETED"):
        setattr(mod, "INTERPRETED", False)


def find(name):
    for mod in reversed(mods):
        if name in vars(mod) and not isinstance(vars(mod)[name], Recorder):
            return vars(mod)[name]


gemv, decode, prefill = (
    find("gemv"),
    find("paged_decode_attention"),
    find("paged_prefill_attention"),
)
add_rmsnorm, norm_rope, silu_mul, write_kv, NormRope = (
    find(n) for n in ("add_rmsnorm", "norm_rope", "silu_mul", "write_kv", "NormRope")
)
int4_gemv = find("int4_gemv")
bf, t = torch.bfloat16, "triton"
E = lambda *s, dtype=bf: torch.zeros(*s, dtype=dtype)
for (n, k), extra in (
    ((6144, 2560), dict(norm=E(2560))),
    ((2560, 4096), dict(residual=E(1, 2560))),
    ((19456, 2560), dict(norm=E(2560), swiglu=True)),
    ((2560, 9728), dict(residual=E(1, 2560))),
    ((6144, 2560), {}),
):
    gemv(E(1, k), E(n, k), impl=t, **extra)
    records.append(("case", f"bf16 {n}x{k} {sorted(extra)}"))
    gemv(E(2, k), E(n, k), impl=t)
    records.append(("case", f"bf16 2 rows {n}x{k}"))
    w8, s8 = E(n, k, dtype=torch.int8), E(n, dtype=torch.float32)
    folds = (
        dict(norm_sums=E(1, dtype=torch.float32))
        if n != 2560
        else dict(residual=E(1, n), hand_off=(E(n), E(1, dtype=torch.float32)))
    )
    gemv(E(1, k), w8, None, s8, impl=t, swiglu=n == 19456 and "residual" not in folds, **folds)
    records.append(("case", f"int8 {n}x{k}"))
for batch, width in ((1, 32), (8, 128), (64, 128)):
    q, kc = E(batch, 32, 128), E(200, 16, 8, 128)
    tables, ctx = (
        torch.zeros(batch, width, dtype=torch.int32),
        torch.full((batch,), 300, dtype=torch.int32),
    )
    nk, nv, slots = E(batch, 8, 128), E(batch, 8, 128), torch.zeros(batch, dtype=torch.int64)
    rope = NormRope(
        E(128), E(128), 1e-6, E(batch, 64, dtype=torch.float32), E(batch, 64, dtype=torch.float32)
    )
    decode(q, kc, kc.clone(), tables, ctx, 128**-0.5, impl=t, new_kv=(nk, nv, slots), rope=rope)
    records.append(("case", f"decode {batch}"))
    decode(q, kc, kc.clone(), tables, ctx, 128**-0.5, impl=t)
    records.append(("case", f"decode plain {batch}"))
prefill(
    E(40, 32, 128),
    E(200, 16, 8, 128),
    E(200, 16, 8, 128),
    torch.zeros(2, 8, dtype=torch.int32),
    torch.tensor([0, 20, 40]),
    torch.tensor([20, 100]),
    20,
    0.1,
    impl=t,
)
for rows in (1, 64):
    add_rmsnorm(E(rows, 2560), E(rows, 2560), E(2560), 1e-6, impl=t)
    norm_rope(
        E(rows, 40, 128),
        E(128),
        1e-6,
        E(rows, 64),
        E(rows, 64),
        impl=t,
        k_weight=E(128),
        num_q_heads=32,
    )
    silu_mul(E(rows, 2 * 9728), impl=t)
    write_kv(
        E(200, 16, 8, 128),
        E(200, 16, 8, 128),
        torch.zeros(rows, dtype=torch.int64),
        E(rows, 8, 128),
        E(rows, 8, 128),
        impl=t,
    )
from forge_engine.quant.formats import quantize_int4

for n, k in ((6144, 2560), (2560, 4096), (19456, 2560)):
    packed = quantize_int4(torch.randn(n, k) / 50, group=128)
    for extra in ({}, dict(swiglu=True) if n == 19456 else dict(residual=E(1, n))):
        int4_gemv(E(1, k), *packed, pdl=True, **extra)
        records.append(("case", f"int4 {n}x{k} {sorted(extra)}"))
DROPPED = {
    "PREFETCH",
    "LOOP_STAGES",
    "ONE_LOOP",
}  # at 0, 1, True in every launch before their removal
out = [
    (name, {k: v for k, v in kw.items() if k not in DROPPED}) if name != "case" else (name, kw)
    for name, kw in records
]
json.dump(out, open(sys.argv[1], "w"), indent=0)
print(len(out), "records")
