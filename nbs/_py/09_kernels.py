# %% [markdown]
# # Kernels: Triton here, or not
#
# > Which implementation runs where (Triton on a CUDA GPU, PyTorch elsewhere, Triton's interpreter for the tests), the pieces every kernel chapter shares, and programmatic dependent launch.

# %% [markdown]
# Chapters 03 and 05 wrote every operation in plain PyTorch. That is right for reading and for
# the CPU, but on a GPU three things cost more than they should:
#
# - **the residual add and RMSNorm** run as half a dozen small kernels, each reading and
#   writing the hidden state again; one kernel can read `x` and the residual once and write
#   the new residual and the normalised row once;
# - **decode attention** gathers every sequence's K/V through its block table into a padded
#   copy, then runs attention over the copy: the K/V is read twice and written once. A kernel
#   can read it once, straight from the pool, and read each KV head *once for its whole group
#   of query heads* (GQA: Qwen3-4B has 4 query heads per KV head);
# - **prefill attention** loops over sequences in Python, one gather each.
#
# What each is worth is napkin math against the H200's measured ceilings
# (chapter 13's `ceilings`): 4.19 TB/s of HBM read, ~790 TFLOP/s of dense bf16.
# Decode attention is pure bandwidth: Qwen3-4B keeps 16 KiB of K/V per token and layer
# (8 heads x 128 x 2 bytes x K,V), so 64 sequences of 1,024 tokens are 1 GiB per layer,
# 256 µs at the ceiling. Prefill is arithmetic: 4 x tokens x context x heads x head_dim FLOPs.
# The variants measured against these, with their numbers, are in `kernels_lab/`; the winners are here.
#
# Every kernel has a PyTorch path that computes the same thing (it is also the reference the
# tests compare with): the engine runs on a CPU, or on a GPU without Triton, with the same API.
# `impl="auto"` picks Triton on a CUDA tensor when Triton is installed, PyTorch otherwise.
#
# The kernels come in four chapters after this one, each with the PyTorch reference it is
# tested against:
#
# | chapter | module | holds |
# |---|---|---|
# | 09_kernels | `kernels.backend` | Triton here or not (this chapter): `kernel_backend`, the dot helper, dependent launches |
# | 09_kernels_elementwise | `kernels.elementwise` | add+RMSNorm, q/k-norm+RoPE, SiLU-mul, the K/V store, the argmax of each row |
# | 09_kernels_gemv | `kernels.gemv` | the GEMV for 1-4 rows (BF16, int8) and the folds in its epilogue |
# | 09_kernels_paged_attention | `kernels.paged_attention` | the paged attention reference, paged decode attention |
# | 09_kernels_prefill_attention | `kernels.prefill_attention` | varlen prefill attention, the attention backends |

# %%
#| default_exp kernels.backend

# %% [markdown]
# ## Triton here, or not
#
# Without a GPU, Triton can still *interpret* a kernel on the CPU (numpy runs each program in
# turn). That is how CI tests the kernels; it is far too slow to serve with. The interpreter
# has to be switched on before `triton` is first imported (Triton's own `tl.zeros` and friends
# are jit functions, decorated at import). So this module, the lowest of the `kernels` package,
# does it as the first thing it does: `interpret_without_a_gpu` sets `TRITON_INTERPRET=1` when
# there is no CUDA device (and the variable is not set already), then imports `triton`, and
# `INTERPRETED` records the outcome. Every other kernel module imports this one first; so does
# `forge-engine doctor` and every lab, before anything imports `triton`. The package's
# `__init__` does nothing: `import forge_engine.kernels` alone sets nothing. Where Triton is not
# installed at all (macOS, Windows), the kernels are still defined, by a stand-in decorator, but
# never launched.

# %%
#| export
import functools
import os

import torch


def interpret_without_a_gpu() -> bool:
    """Where no CUDA device is, ask Triton to interpret its kernels (TRITON_INTERPRET=1, unless the variable is set
    already): must run before the first `import triton`. Whether Triton will interpret."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETED = interpret_without_a_gpu()  # (at import, before `import triton` just below)

try:
    import triton
    import triton.language as tl

    TRITON_VERSION: str | None = triton.__version__
except (
    ImportError
):  # the PyTorch paths still work; the kernel definitions below are read but never launched

    class _NoTriton:
        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _NoTriton()
    TRITON_VERSION = None

# %%
#| hide
import pytest

# %% [markdown]
# `kernel_backend` is the one place that decides which implementation runs; `kernels_report`
# says it in a line for `forge-engine doctor`.

# %%
#| export
IMPLS = ("auto", "triton", "torch")


def kernel_backend(device, impl: str = "auto") -> str:
    "'triton' or 'torch': what runs for tensors on `device`. 'auto' takes Triton on a CUDA device when Triton is installed."
    if impl not in IMPLS:
        raise ValueError(
            f"unknown kernel implementation {impl!r}; choose one of {', '.join(IMPLS)}"
        )
    if impl == "triton" and TRITON_VERSION is None:
        raise ValueError("impl='triton' needs the triton package, which is not installed")
    if impl != "auto":
        return impl
    return (
        "triton" if TRITON_VERSION is not None and torch.device(device).type == "cuda" else "torch"
    )


def kernels_available(device="cuda") -> bool:
    "True when the Triton kernels run natively (not interpreted) on `device`."
    return (
        torch.device(device).type == "cuda"
        and torch.cuda.is_available()
        and kernel_backend(device) == "triton"
    )


def kernels_report() -> str:
    "One line for `forge-engine doctor`: which implementation the kernels of this chapter run as here."
    if TRITON_VERSION is None:
        return "PyTorch (Triton not installed)"
    if kernels_available():
        return (
            f"Triton {TRITON_VERSION} on CUDA: fused add+RMSNorm, q/k-norm+RoPE, SiLU-mul, K/V store, GEMV; "
            f"paged decode (Triton: the CUDA C++ contender of kernels_lab was 2.4-8x slower) and prefill attention"
        )
    return f"PyTorch (no CUDA GPU; Triton {TRITON_VERSION} runs the kernels only interpreted, for tests)"


# %%
assert kernel_backend("cpu") == "torch" and kernel_backend("cpu", "torch") == "torch"
assert kernel_backend("cpu", "triton") == "triton"  # forced: the interpreter on a CPU tensor
with pytest.raises(ValueError, match="unknown kernel implementation 'cuda'"):
    kernel_backend("cpu", "cuda")
assert not kernels_available("cpu")
if not torch.cuda.is_available():
    assert kernels_report().startswith("PyTorch (no CUDA GPU")
print(kernels_report())


# %% [markdown]
# A bug to know about: in Triton 3.7's interpreter, `tl.dot` multiplies bf16 operands as their
# raw 16-bit patterns. Interpreted kernels therefore upcast dot operands to fp32 first (a
# no-op for fp32; exact for bf16 values). Compiled kernels keep bf16 operands for the tensor
# cores. For fp32 inputs we ask the compiler for full fp32 dots (`ieee`), not TF32, so fp32
# results match the reference to ~1e-6. And the interpreter rounds fp32 -> bf16 by truncation,
# not to nearest as the GPU does: interpreted bf16 results agree to bf16 tolerances, not bits.

# %%
#| export
@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _stages(num_stages: int | None) -> dict:
    return {} if num_stages is None else {"num_stages": num_stages}


@functools.cache
def split_k_programs(device, per_sm: int = 4) -> int:
    """The programs a launch split along K aims for (chapter 10b's skinny matmuls, chapter 09's tensor-core matmul for
    several rows): `per_sm` an SM, four by default, enough to keep every SM streaming; 8 where there is no GPU (the
    interpreter's tests)."""
    device = torch.device(device)
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


# Programmatic dependent launch (Hopper and newer; chapter 09_kernels_gemv tells why): a
# kernel launched with it may start while the kernel before it is still finishing, once that
# kernel allows it; it must wait (`gdc_wait`) before reading what that kernel writes.
@functools.cache
def pdl_supported(device) -> bool:
    "Programmatic dependent launch here: compiled kernels on compute capability 9 (Hopper) or newer."
    device = torch.device(device)
    return (
        device.type == "cuda"
        and not INTERPRETED
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@triton.jit
def _let_next_start(PDL: tl.constexpr, WAIT: tl.constexpr):
    """Allow the next kernel, if launched as a dependent, to start now (it waits for our results before reading them);
    WAIT: this kernel was launched as one, so it waits for the kernel before it to finish."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _wait_for_previous(WAIT)


@triton.jit
def _wait_for_previous(WAIT: tl.constexpr):
    "Launched as a dependent (WAIT): wait here until the kernel before has finished and its writes are visible."
    if WAIT:
        tl.extra.cuda.gdc_wait()


DEPENDENT_LAUNCH_MAX_ROWS = (
    4  # the small decode kernels launched as dependents in steps of at most this many rows
)
# (tokens or sequences): the GEMV steps, where it was measured faster (chapter 09_kernels_gemv)


def _pdl_args(device, waits_late: bool = False, rows: int = 1) -> dict:
    """Launch arguments of a small kernel of the decode step (norms, RoPE, K/V store, SiLU-mul, decode attention) over
    `rows` rows: it lets the next kernel start early, and (at most DEPENDENT_LAUNCH_MAX_ROWS rows) is launched early
    itself, waiting for its input. `waits_late`: launched early in any case; the kernel waits itself, further on
    (the decode attention's early tile, the verify kernel's scans of its rows)."""
    pdl = pdl_supported(device)
    dependent = pdl and (waits_late or rows <= DEPENDENT_LAUNCH_MAX_ROWS)
    return dict(PDL=pdl, WAIT=dependent and not waits_late, launch_pdl=dependent)
