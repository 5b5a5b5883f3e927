"""Paged GQA decode attention in CUDA C++, built just in time: the contender to the Triton kernel.

Same problem and napkin math as decode_attention.py (one query token per sequence, K/V read once
through the block tables; bandwidth-bound: judge by bytes / time against 4.19 TB/s).

The CUDA design (c1): a thread block per (sequence, KV head, split of the context), four warps.
A warp takes one key at a time: each lane loads 4 of its 128 dims of K (8 bytes, so a warp reads
the key's 256 bytes in one coalesced load), multiplies them with the same 4 dims of the group's
query heads (kept in registers), and a butterfly of shuffles sums the dot products across the
warp. Online softmax per query head in registers; V accumulates the same way. The four warps'
partial results meet in shared memory, then a second small kernel merges the splits (the
flash-decoding merge) and writes bf16. No tensor cores: with 4 query heads per KV head there is
too little arithmetic per byte to need them, which is the bet this variant tests against
Triton's tensor-core tile.

Variants
  t3  the exported Triton kernel (forge_engine.kernels.paged_decode_attention)
  c1  the CUDA C++ kernel above, split like the Triton one (512 keys per split)
  c2  c1 with 8 keys per warp in flight: c1 measured 101 us for one sequence of 512 keys (0.5% of
      the bandwidth), the time of ~128 dependent memory round trips, one per key a warp takes
      (c1 with 1024-key splits was slower still, 2x at 4K keys, and is gone)
  c2-256  c2 with 256-key splits (more thread blocks for short batches)

Run on a GPU (needs nvcc and ninja; the first run compiles for ~1 minute):
    PYTHONPATH=. python3 kernels_lab/decode_attention_cuda.py
On a CPU it says there is nothing to build and exits 0 after checking nothing.
"""

import math

from common import (
    DEVICE,
    ON_GPU,
    Results,
    finish,
    time_variant,
    validate,
)  # first: it may switch on the interpreter
import torch
import decode_attention  # its test cases
from forge_engine.kernels.paged_attention import (
    decode_split_len,
    paged_attention_reference,
    paged_decode_attention,
)

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <cuda_bf16.h>
#include <ATen/cuda/CUDAContext.h>

constexpr int WARPS = 4;

template <int GROUP, int HEAD_DIM, int UNROLL>
__global__ void decode_splits(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
                              const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ tables,
                              const int* __restrict__ lens, float* __restrict__ part_acc,
                              float* __restrict__ part_m, float* __restrict__ part_l,
                              int q_stride_b, int q_heads, int kv_heads, int block_size, int table_stride,
                              int split_len, int num_splits, float scale_log2) {
  constexpr int PER_LANE = HEAD_DIM / 32;  // dims each lane owns: 4 for head_dim 128
  const int b = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int len = lens[b];
  const int start = split * split_len, end = min(len, start + split_len);

  float qr[GROUP][PER_LANE], acc[GROUP][PER_LANE], m[GROUP], l[GROUP];
  #pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = -INFINITY; l[g] = 0.f;
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      qr[g][i] = __bfloat162float(q[(long)b * q_stride_b + (kvh * GROUP + g) * HEAD_DIM + lane * PER_LANE + i]) * scale_log2;
      acc[g][i] = 0.f;
    }
  }
  // UNROLL keys a warp at a time: all their loads are issued before the first one is used, so the
  // warp waits for memory once per UNROLL keys instead of once per key
  for (int t0 = start + warp * UNROLL; t0 < end; t0 += WARPS * UNROLL) {
    __nv_bfloat16 kb[UNROLL][PER_LANE], vb[UNROLL][PER_LANE];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = min(t0 + u, end - 1);  // past the end: reload the last key, masked below
      const long block = tables[(long)b * table_stride + t / block_size];
      const long base = ((block * block_size + t % block_size) * kv_heads + kvh) * HEAD_DIM + lane * PER_LANE;
      #pragma unroll
      for (int i = 0; i < PER_LANE; ++i) { kb[u][i] = k_cache[base + i]; vb[u][i] = v_cache[base + i]; }
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (t0 + u >= end) break;
      #pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float s = 0.f;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) s += qr[g][i] * __bfloat162float(kb[u][i]);
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
        const float m_new = fmaxf(m[g], s), corr = exp2f(m[g] - m_new), p = exp2f(s - m_new);
        l[g] = l[g] * corr + p;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[g][i] = acc[g][i] * corr + p * __bfloat162float(vb[u][i]);
        m[g] = m_new;
      }
    }
  }
  // the warps' partial softmax states meet in shared memory
  __shared__ float sm_m[WARPS][GROUP], sm_l[WARPS][GROUP], sm_acc[WARPS][GROUP][HEAD_DIM];
  #pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) sm_acc[warp][g][lane * PER_LANE + i] = acc[g][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += blockDim.x) {
    const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = -INFINITY;
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lsum = 0.f, a = 0.f;
    if (mx != -INFINITY) {  // an empty split (past the end of a short sequence) stays (-inf, 0, 0)
      for (int w = 0; w < WARPS; ++w) {
        const float f = exp2f(sm_m[w][g] - mx);
        lsum += sm_l[w][g] * f;
        a += sm_acc[w][g][d] * f;
      }
    }
    const long row = ((long)b * q_heads + kvh * GROUP + g) * num_splits + split;
    part_acc[row * HEAD_DIM + d] = a;
    if (d == 0) { part_m[row] = mx; part_l[row] = lsum; }
  }
}

template <int HEAD_DIM>
__global__ void merge_splits(const float* __restrict__ part_acc, const float* __restrict__ part_m,
                             const float* __restrict__ part_l, __nv_bfloat16* __restrict__ out, int out_stride_b,
                             int q_heads, int num_splits) {
  const int b = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const long row0 = ((long)b * q_heads + h) * num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_m[row0 + s]);
  float lsum = 0.f, a = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float f = part_m[row0 + s] == -INFINITY ? 0.f : exp2f(part_m[row0 + s] - mx);
    lsum += part_l[row0 + s] * f;
    a += part_acc[(row0 + s) * HEAD_DIM + d] * f;
  }
  out[(long)b * out_stride_b + h * HEAD_DIM + d] = __float2bfloat16(a / lsum);
}

template <int GROUP, int HEAD_DIM, int UNROLL>
void launch(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables, torch::Tensor lens,
            torch::Tensor out, int split_len, int num_splits, double scale) {
  const int batch = q.size(0), q_heads = q.size(1), kv_heads = k.size(2), block_size = k.size(1);
  auto f32 = q.options().dtype(torch::kFloat32);
  auto part_acc = torch::empty({batch, q_heads, num_splits, HEAD_DIM}, f32);
  auto part_m = torch::empty({batch, q_heads, num_splits}, f32), part_l = torch::empty({batch, q_heads, num_splits}, f32);
  auto stream = at::cuda::getCurrentCUDAStream();
  decode_splits<GROUP, HEAD_DIM, UNROLL><<<dim3(batch, kv_heads, num_splits), 32 * WARPS, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(k.data_ptr()),
      reinterpret_cast<const __nv_bfloat16*>(v.data_ptr()), tables.data_ptr<int>(), lens.data_ptr<int>(),
      part_acc.data_ptr<float>(), part_m.data_ptr<float>(), part_l.data_ptr<float>(), q.stride(0), q_heads,
      kv_heads, block_size, tables.stride(0), split_len, num_splits, (float)(scale * 1.4426950408889634));
  merge_splits<HEAD_DIM><<<dim3(batch, q_heads), HEAD_DIM, 0, stream>>>(
      part_acc.data_ptr<float>(), part_m.data_ptr<float>(), part_l.data_ptr<float>(),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), out.stride(0), q_heads, num_splits);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lens, int64_t split_len, int64_t num_splits, double scale, int64_t unroll) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && q.stride(2) == 1, "contiguous K/V, unit-stride q rows");
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && lens.scalar_type() == torch::kInt32, "int32 tables/lens");
  auto out = torch::empty_like(q);
  const int group = q.size(1) / k.size(2), dim = q.size(2);
  TORCH_CHECK(unroll == 1 || unroll == 8, "unroll is 1 or 8");
  if (group == 4 && dim == 128 && unroll == 1) launch<4, 128, 1>(q, k, v, tables, lens, out, split_len, num_splits, scale);
  else if (group == 4 && dim == 128) launch<4, 128, 8>(q, k, v, tables, lens, out, split_len, num_splits, scale);
  else if (group == 8 && dim == 64 && unroll == 1) launch<8, 64, 1>(q, k, v, tables, lens, out, split_len, num_splits, scale);
  else if (group == 8 && dim == 64) launch<8, 64, 8>(q, k, v, tables, lens, out, split_len, num_splits, scale);
  else if (group == 1 && dim == 128 && unroll == 1) launch<1, 128, 1>(q, k, v, tables, lens, out, split_len, num_splits, scale);
  else if (group == 1 && dim == 128) launch<1, 128, 8>(q, k, v, tables, lens, out, split_len, num_splits, scale);
  else TORCH_CHECK(false, "this lab kernel is built for (group, head_dim) in (4,128), (8,64), (1,128)");
  return out;
}
"""
CPP_DECLARATION = (
    "torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables, "
    "torch::Tensor lens, int64_t split_len, int64_t num_splits, double scale, int64_t unroll);"
)


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "forge_lab_paged_decode",
        cpp_sources=CPP_DECLARATION,
        cuda_sources=CUDA_SOURCE,
        functions=["paged_decode"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"],
        verbose=False,
    )


def cuda_variant(ext, split_tokens=512, unroll=1):
    def run(q, k, v, tables, lens, scale):
        split_len, num_splits = decode_split_len(tables.shape[1], k.shape[1], split_tokens)
        return ext.paged_decode(q, k, v, tables, lens, split_len, num_splits, scale, unroll)

    return run


def case(lens, q_heads, kv_heads, head_dim, block_size):
    "decode_attention.py's bf16 case, with the int32 block tables this kernel takes."
    q, k_cache, v_cache, tables, lens = decode_attention.case(
        lens, q_heads, kv_heads, head_dim, block_size, torch.bfloat16
    )
    return q, k_cache, v_cache, tables.int(), lens


def main():
    if not ON_GPU:
        print("no CUDA GPU: the CUDA C++ kernel is neither built nor checked here")
        return
    ext = build()
    variants = {
        "t3 Triton (exported)": lambda q, k, v, t, c, s: paged_decode_attention(q, k, v, t, c, s),
        "c1 CUDA C++, 512-key splits": cuda_variant(ext),
        "c2 CUDA C++, 8 keys in flight per warp": cuda_variant(ext, unroll=8),
        "c2 CUDA C++, 8 in flight, 256-key splits": cuda_variant(ext, 256, unroll=8),
    }
    ok = True
    print("validation against the reference (gather + fp32 softmax)")
    for lens, hq, hkv, d, bs in [
        ([1, 17, 1000, 4096], 32, 8, 128, 16),
        ([5, 700], 8, 1, 64, 32),
        ([3, 2500], 8, 8, 128, 16),
    ]:
        q, k, v, t, c = case(lens, hq, hkv, d, bs)
        want = paged_attention_reference(
            q, k, v, t, torch.arange(len(lens) + 1, device=DEVICE), c, d**-0.5
        )
        for name, fn in variants.items():
            ok &= validate(
                f"{name} lens={lens} G={hq // hkv} D={d} bs={bs}",
                fn(q, k, v, t, c, d**-0.5),
                want,
                1e-2,
            )
    results = Results(
        "paged decode attention: CUDA C++ vs Triton (Qwen3-4B shapes: 32/8 heads, D 128, block 16, bf16)"
    )
    for batch, ctx in [
        (1, 512),
        (1, 4096),
        (1, 32768),
        (8, 2048),
        (64, 1024),
        (256, 512),
        (256, 2048),
    ]:
        q, k, v, t, c = case([ctx] * batch, 32, 8, 128, 16)
        nbytes = batch * ctx * 8 * 128 * 2 * 2 + 2 * q.nbytes
        for name, fn in variants.items():
            ms, how = time_variant(lambda: fn(q, k, v, t, c, 128**-0.5), graph=True)
            results.add(f"B={batch} ctx={ctx}", f"{name} [{how}]", ms, nbytes)
    results.print()
    finish(ok)


if __name__ == "__main__":
    main()
