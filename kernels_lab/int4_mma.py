"""int4 (and int8) decode GEMV on the tensor cores (CUDA C++, built just in time): the contender to chapter 10's
`int4_gemv`.

Why: chapter 10's int4 GEMV spends ~4 instructions a weight unpacking nibbles and multiply-adding them in FP32, and
an H200 issues ~33 trillion thread-instructions a second: at 4.19 TB/s (8.4 trillion int4 weights a second) that is
the whole issue rate, so it reads at 1.4-2 TB/s (the int4 W1 step's 144 GEMVs took 1.14 ms for 1.72 GB).
An `mma.sync.m16n8k16` multiplies a 16 x 16 BF16 tile by 16 x 8 in one warp instruction: 256 weights. With x in every
column of the 16 x 8 operand (batch 1: the 8 columns are copies; column 0 is read), the per-weight work is only the
unpacking into the A operand's registers.

(Counted offline: the exported int4 loop at 4 rows, 4 warps, 16-byte chunks is 453 instructions for a
thread's 128 weights a step, 3.5 a weight (`gemv_sass.py`'s `int4_loop`): at 3.7 TB/s that is ~3 of the 4
warp-instructions an SM issues a cycle.)

Design (q1, commit e420964): a thread block per 16 weight rows, WARPS warps, each warp a share of the K groups
(group g to warp g % WARPS). Thread (r = lane / 4, t = lane % 4) loads 16 bytes of rows r and r + 8 per group of 128
inputs (64 bytes a row: chapter 10's packing, byte j = input j low, input j + 64 high): four 32-bit words a row. One
word gives four A registers of two BF16 each, one LOP3 (and a shift) apiece: (w >> s) & 0x000F000F | 0x43004300 is
the BF16 pair (128 + nibble at s, 128 + nibble at s + 16). Two mma per word: (low nibbles of bytes 0, 2 | high of 0,
2) and (low of 1, 3 | high of 1, 3). The inputs are matched by putting x, once per block, in shared memory in the B
operand's order (`xp`: per group, t and word, the 4 words of the two mma's B registers: one 16-byte load). Each
group's sums come out of the accumulators (every column of C holds them); 128 x Σx of the group comes off (the BF16
values are 128 + q), then scale and minimum as chapter 10 applies them. Warps' sums meet in shared memory.

Napkin math per mma (256 weights, 128 bytes): ~4 LOP3 + 2 shifts + 1 shared load + 1 HMMA per thread, i.e. ~8 warp
instructions per 256 weights, ~1/30 of an instruction a weight against ~4 in chapter 10's loop: memory-bound, if the
loads keep enough bytes in flight (IN_FLIGHT groups a warp: 2 x 16 bytes a thread each).

Measured (one H200; µs a matrix in the chain, q1 at its best warps / groups in flight against t0): valid everywhere,
but slower: qkv 6.75 vs 5.96, o 6.86 vs 3.77, gate-up 15.72 vs 12.96, down 13.32 vs 8.06. Its prologue is the suspect:
every block rewrites all of x into shared memory (for down 19 rounds of two L2 loads a thread, one after another) and
waits at a barrier before its first mma, and o / down have only 160 blocks of 16 rows.

q2 (commit e420964) dropped the prologue: the A registers take their nibbles in x's own order (`__byte_perm` puts
bytes (0, 1) or (2, 3) of a word into bytes 0 and 2 before the mask: one PRMT more, one shift less a register), so
each lane's B registers are x's words as they lie in memory, loaded straight from L1 (4 x 16 bytes a group); the
group's Σx comes from mma with an A of ones on the same B registers (8 more mma a group, no shared memory, no barrier
before the loop); a warp may take TILES tiles of 16 rows sharing its x. Measured: valid, slower still (best of 8
configurations, µs a matrix, against t0): qkv 5.95 vs 5.93, o 5.76 vs 3.76, gate-up 13.69 vs 12.94, down 13.04 vs
8.05. Its loop refilled all IN_FLIGHT groups only after using them all, so a warp waited for each batch of loads in
turn.

q3 (`int4_mma_gemv`, this file): q2's arithmetic with each of a warp's IN_FLIGHT slots (weights, scales, minimums and
x of one group) refilled with its next group as soon as it is used, weights loaded past L1
(`ld.global.nc.L1::no_allocate`). Measured, best configuration against t0: qkv **5.07** vs 5.93 (4 warps, 4 groups in
flight), o 5.02 vs 3.76, gate-up 13.72 vs 12.94, down 11.86 vs 8.05. Faster only for qkv; o and down have 160 tiles of
16 rows for 132 SMs, each warp a long serial chain of groups (q4 splits K over blocks); not taken into chapter 10 (it
would also bring a CUDA build step to the package).

q4 (`mma_gemv_staged`; compiled: 52-56 registers, no spills; int4, and int8 weights too, below): a block per tile of
16 rows and share of K (`splits` blocks a tile); before waiting for x it asks for its whole share of weight bytes into
shared memory with `cp.async` (no registers held: 16-28 KB a block in flight, several blocks an SM), then x's share
the same way; the warps take the groups in turn with q3's arithmetic (`group_x_sum`, `tile_group_sums`); a tile's last
block to finish adds the splits' partial sums in order (a counter a tile, as chapter 09's decode attention merges its
splits). For o and down (160 tiles) the splits give the grid its blocks; for qkv and gate-up the staging replaces q3's
register slots. int8 through the same mma: a byte XOR 0x80 is u = w + 128 = 16 hi + lo, its nibbles go into A as
int4's do, B holds x against the low nibbles and 16 x (exact in BF16) against the high ones, so C = Σ w x + 2304 Σ x;
against chapter 09's int8 GEMV (t0 for int8). The question for int8 is not arithmetic (its chain is ~1.8 µs a launch
plus 3.7 TB/s) but whether a whole share in flight before the wait for x shortens the launch boundaries. Measured:
valid, slower than t0 everywhere, int8 too; not taken.

Variants: t0 the exported Triton `int4_gemv` (chapter 10); q3-W-F-T: W warps, F groups in flight a warp, T tiles of
16 rows a warp; q4-W-S: W warps, K in S splits (first validated at a partial tile with uneven splits, twice: the
counters must come back to zero). Each timed as a CUDA graph of 36 distinct matrices of a Qwen3-4B shape (as
gemv_chain_sweep.py), dependent launches on for both. `emulate` runs the kernel's index arithmetic in PyTorch on a
CPU (the mma fragments as the PTX manual lays them out) against the reference.

Run: PYTHONPATH=. python3 kernels_lab/int4_mma.py [int4,int8 | emulate]   (GPU: needs nvcc; the first build takes
~1 minute)"""

import sys

import torch
import torch.nn.functional as F

from forge_engine.quant.formats import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>


__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t nibble_pair(uint32_t w, uint32_t selector, int shift) {
  // the two bytes `selector` picks, put in bytes 0 and 2; of each the nibble at `shift`: a BF16 (128 + it) pair
  return ((__byte_perm(w, 0, selector) >> shift) & 0x000F000Fu) | 0x43004300u;
}

constexpr uint32_t BF16_ONES = 0x3F803F80u;  // (1.0, 1.0)

// One group of 128 inputs for a lane (r = lane / 4, t = lane % 4): xl / xh its 16 inputs 16t .. 16t + 15 and the 16
// from 64 + 16t on, as 8 words of two BF16 each (x's own order); wl / wh the 16 bytes 16t .. of rows r and r + 8.
__device__ __forceinline__ float group_x_sum(const uint32_t (&xl)[8], const uint32_t (&xh)[8]) {
  float ones[4] = {0.f, 0.f, 0.f, 0.f};  // A all ones: every C element is the group's Σ x
  #pragma unroll
  for (int i = 0; i < 8; ++i) mma_bf16(ones, BF16_ONES, BF16_ONES, BF16_ONES, BF16_ONES, xl[i], xh[i]);
  return ones[0];
}

__device__ __forceinline__ void tile_group_sums(float (&c)[4], uint4 wl, uint4 wh, const uint32_t (&xl)[8],
                                                const uint32_t (&xh)[8]) {
  // c[0]: row r's Σ (128 + q) x over the group, c[2]: row r + 8's (columns 2t, 2t + 1 of C: every column holds them)
  c[0] = c[1] = c[2] = c[3] = 0.f;
  const uint32_t lo[4] = {wl.x, wl.y, wl.z, wl.w}, hi[4] = {wh.x, wh.y, wh.z, wh.w};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {  // word i: bytes 16t + 4i .. + 3 of a row, inputs 16t + 4i .. + 3 (and + 64)
    mma_bf16(c, nibble_pair(lo[i], 0x1100, 0), nibble_pair(hi[i], 0x1100, 0), nibble_pair(lo[i], 0x1100, 4),
             nibble_pair(hi[i], 0x1100, 4), xl[2 * i], xh[2 * i]);
    mma_bf16(c, nibble_pair(lo[i], 0x3322, 0), nibble_pair(hi[i], 0x3322, 0), nibble_pair(lo[i], 0x3322, 4),
             nibble_pair(hi[i], 0x3322, 4), xl[2 * i + 1], xh[2 * i + 1]);
  }
}

__device__ __forceinline__ uint4 load_streaming(const void* p) {  // weights: read once, kept out of L1 (x lives there)
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// q3: a warp takes TILES x 16 rows and every WARPS-th group; x straight from memory (L1) in its natural order; a warp's
// IN_FLIGHT slots each hold one group (weights, scales, minimums, x), a slot refilled with its next group as soon as
// it is used, so IN_FLIGHT - 1 groups are always on their way
template <int WARPS, int IN_FLIGHT, int TILES>
__global__ void __launch_bounds__(WARPS * 32) int4_mma_gemv(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ q, const __half* __restrict__ scale,
    const __half* __restrict__ minimum, __nv_bfloat16* __restrict__ y, int N, int K) {
  asm volatile("griddepcontrol.launch_dependents;");
  __shared__ float part[WARPS][16 * TILES];
  const int G = K / 128;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * 16 * TILES;
  int rows[2 * TILES];  // rows r and r + 8 of each tile (past N: computed, not stored)
  #pragma unroll
  for (int j = 0; j < 2 * TILES; ++j) rows[j] = min(row0 + (j / 2) * 16 + (j % 2) * 8 + r, N - 1);
  uint4 w[IN_FLIGHT][2 * TILES], xv[IN_FLIGHT][4];
  __half s[IN_FLIGHT][2 * TILES], m[IN_FLIGHT][2 * TILES];
  const uint4* x8 = reinterpret_cast<const uint4*>(x);  // 8 BF16 a load
  auto load_weights = [&](int u, int grp) {
    if (grp < G) {
      #pragma unroll
      for (int j = 0; j < 2 * TILES; ++j) {
        w[u][j] = load_streaming(q + (size_t)rows[j] * (K / 2) + grp * 64 + t * 16);
        s[u][j] = scale[(size_t)rows[j] * G + grp];
        m[u][j] = minimum[(size_t)rows[j] * G + grp];
      }
    }
  };
  auto load_x = [&](int u, int grp) {  // this thread's inputs of the group: 16t .. 16t + 15 (low nibbles), 64 + those
    if (grp < G) {
      xv[u][0] = __ldg(x8 + grp * 16 + 2 * t); xv[u][1] = __ldg(x8 + grp * 16 + 2 * t + 1);
      xv[u][2] = __ldg(x8 + grp * 16 + 8 + 2 * t); xv[u][3] = __ldg(x8 + grp * 16 + 8 + 2 * t + 1);
    }
  };
  #pragma unroll
  for (int u = 0; u < IN_FLIGHT; ++u) load_weights(u, warp + u * WARPS);  // before the wait: not the last kernel's
  asm volatile("griddepcontrol.wait;" ::: "memory");
  #pragma unroll
  for (int u = 0; u < IN_FLIGHT; ++u) load_x(u, warp + u * WARPS);
  float acc[2 * TILES];
  #pragma unroll
  for (int j = 0; j < 2 * TILES; ++j) acc[j] = 0.f;
  for (int first = warp; first < G; first += WARPS * IN_FLIGHT) {
    #pragma unroll
    for (int u = 0; u < IN_FLIGHT; ++u) {
      const int grp = first + u * WARPS;
      if (grp < G) {
        const uint32_t xl[8] = {xv[u][0].x, xv[u][0].y, xv[u][0].z, xv[u][0].w,
                                xv[u][1].x, xv[u][1].y, xv[u][1].z, xv[u][1].w};
        const uint32_t xh[8] = {xv[u][2].x, xv[u][2].y, xv[u][2].z, xv[u][2].w,
                                xv[u][3].x, xv[u][3].y, xv[u][3].z, xv[u][3].w};
        const float xs = group_x_sum(xl, xh);
        #pragma unroll
        for (int j = 0; j < TILES; ++j) {
          float c[4];
          tile_group_sums(c, w[u][2 * j], w[u][2 * j + 1], xl, xh);
          acc[2 * j] += __half2float(s[u][2 * j]) * (c[0] - 128.f * xs) + __half2float(m[u][2 * j]) * xs;
          acc[2 * j + 1] += __half2float(s[u][2 * j + 1]) * (c[2] - 128.f * xs) + __half2float(m[u][2 * j + 1]) * xs;
        }
        load_weights(u, grp + WARPS * IN_FLIGHT);  // the slot's next group
        load_x(u, grp + WARPS * IN_FLIGHT);
      }
    }
  }
  if (t == 0) {
    #pragma unroll
    for (int j = 0; j < TILES; ++j) {
      part[warp][j * 16 + r] = acc[2 * j];
      part[warp][j * 16 + r + 8] = acc[2 * j + 1];
    }
  }
  __syncthreads();
  if (threadIdx.x < 16 * TILES && row0 + threadIdx.x < N) {
    float sum = 0.f;
    #pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += part[v][threadIdx.x];
    y[row0 + threadIdx.x] = __float2bfloat16(sum);
  }
}

__device__ __forceinline__ void copy_async16(void* to_shared, const void* from_global) {  // 16 bytes, past L1
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(to_shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(to), "l"(from_global));
}

// q4: a block takes a tile of 16 rows and a share of the K groups (split blockIdx.y of gridDim.y). Before it waits
// for x it asks for all of its weight bytes at once into shared memory (cp.async: nothing held in registers, the
// whole share in flight), and reads its scales (and minimums); after the wait, x's share the same way. Then the warps
// take the share's groups in turn (q3's arithmetic). With K split, each block leaves its 16 partial sums in `part`
// and the last of a tile's blocks to finish (a counter a tile, left at zero for the next call) adds them in split
// order and writes the rows.
// INT8: int8 weights with a scale a row, through the same mma. A group is 64 bytes of a row either way (int8: 64
// inputs). Each byte XOR 0x80 is u = w + 128 = 16 hi + lo; its two nibbles go into A as int4's do, and B holds x
// against the low nibbles and 16 x (exact in BF16) against the high ones: C = Σ (128 + lo) x + (128 + hi) 16 x
// = Σ w x + 2304 Σ x, and the ones-mma gives Σ (x + 16 x) = 17 Σ x.
template <int WARPS, bool INT8>
__global__ void __launch_bounds__(WARPS * 32) mma_gemv_staged(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ q, const void* __restrict__ scale,
    const __half* __restrict__ minimum, __nv_bfloat16* __restrict__ y, float* __restrict__ part,
    int* __restrict__ counters, int N, int K) {
  asm volatile("griddepcontrol.launch_dependents;");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int is_last;
  constexpr int INPUTS = INT8 ? 64 : 128;  // inputs a group (64 bytes of a row)
  const int G = K / INPUTS, splits = gridDim.y, split = blockIdx.y, tile = blockIdx.x, row0 = tile * 16;
  const int g0 = split * G / splits, ng = (split + 1) * G / splits - g0;
  const int stride = ng * 64 + (ng % 2 ? 0 : 64);  // a row's share, 64 mod 128 bytes: a quarter-warp's two rows
  uint8_t* w_s = smem;                                                  // [16][stride] the weight bytes
  __half2* sm_s = reinterpret_cast<__half2*>(smem + 16 * stride);       // int4: [16][ng] (scale, minimum)
  uint4* x_s = reinterpret_cast<uint4*>(sm_s + (INT8 ? 0 : 16 * ng));   // [ng][16] x (int8: [ng][8] x, [ng][8] 16 x)
  float* red = reinterpret_cast<float*>(x_s + 16 * ng);                 // [WARPS][16] the warps' sums
  for (int c = threadIdx.x; c < 16 * 4 * ng; c += WARPS * 32) {  // 16-byte chunk c: row c / 4ng, 4 a group
    const int r = c / (4 * ng), j = c % (4 * ng);
    copy_async16(w_s + r * stride + j * 16, q + (size_t)min(row0 + r, N - 1) * (K / (INT8 ? 1 : 2)) + g0 * 64 + j * 16);
  }
  asm volatile("cp.async.commit_group;");
  if (!INT8) {
    const __half* s16 = reinterpret_cast<const __half*>(scale);
    for (int c = threadIdx.x; c < 16 * ng; c += WARPS * 32) {
      const size_t at = (size_t)min(row0 + c / ng, N - 1) * G + g0 + c % ng;
      sm_s[c] = __halves2half2(s16[at], minimum[at]);
    }
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the kernel before's output
  const uint4* x8 = reinterpret_cast<const uint4*>(x) + g0 * (INPUTS / 8);
  for (int c = threadIdx.x; c < ng * (INPUTS / 8); c += WARPS * 32) copy_async16(x_s + c, x8 + c);
  asm volatile("cp.async.commit_group;");
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  if (INT8) {  // 16 x beside x: the B operand against the high nibbles
    for (int c = threadIdx.x; c < ng * 8 * 4; c += WARPS * 32) {
      const __nv_bfloat162 v = reinterpret_cast<const __nv_bfloat162*>(x_s)[c];
      reinterpret_cast<__nv_bfloat162*>(x_s + ng * 8)[c] = __hmul2(v, __floats2bfloat162_rn(16.f, 16.f));
    }
    __syncthreads();
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, t = lane % 4;
  float acc_lo = 0.f, acc_hi = 0.f;
  for (int g = warp; g < ng; g += WARPS) {
    // xl: this lane's 16 inputs of the group (int4: 16t..; int8: 16t..), xh: those 64 on (int4) or 16 x of xl (int8)
    const uint4* xlo = x_s + g * (INPUTS / 8) + 2 * t;
    const uint4* xhi = INT8 ? x_s + ng * 8 + g * 8 + 2 * t : xlo + 8;
    const uint4 l0 = xlo[0], l1 = xlo[1], h0 = xhi[0], h1 = xhi[1];
    const uint32_t xl[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
    const uint32_t xh[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    const float xs = group_x_sum(xl, xh);  // int8: 17 Σ x
    uint4 wl = *reinterpret_cast<const uint4*>(w_s + r * stride + g * 64 + t * 16);
    uint4 wh = *reinterpret_cast<const uint4*>(w_s + (r + 8) * stride + g * 64 + t * 16);
    if (INT8) {  // signed bytes -> w + 128
      wl.x ^= 0x80808080u; wl.y ^= 0x80808080u; wl.z ^= 0x80808080u; wl.w ^= 0x80808080u;
      wh.x ^= 0x80808080u; wh.y ^= 0x80808080u; wh.z ^= 0x80808080u; wh.w ^= 0x80808080u;
    }
    float c[4];
    tile_group_sums(c, wl, wh, xl, xh);
    if (INT8) {  // Σ w x = C - 2304 Σ x; the row's scale at the end
      acc_lo += c[0] - (2304.f / 17.f) * xs;
      acc_hi += c[2] - (2304.f / 17.f) * xs;
    } else {
      const float2 lo = __half22float2(sm_s[r * ng + g]), hi = __half22float2(sm_s[(r + 8) * ng + g]);
      acc_lo += lo.x * (c[0] - 128.f * xs) + lo.y * xs;
      acc_hi += hi.x * (c[2] - 128.f * xs) + hi.y * xs;
    }
  }
  if (t == 0) { red[warp * 16 + r] = acc_lo; red[warp * 16 + r + 8] = acc_hi; }
  __syncthreads();
  float sum = 0.f;
  if (threadIdx.x < 16) {
    #pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += red[v * 16 + threadIdx.x];
  }
  const float row_scale = INT8 && threadIdx.x < 16 ?  // int8: the row's scale (past N: the last row's, not stored)
      reinterpret_cast<const float*>(scale)[min(row0 + (int)threadIdx.x, N - 1)] : 1.f;
  if (splits == 1) {
    if (threadIdx.x < 16 && row0 + threadIdx.x < N) y[row0 + threadIdx.x] = __float2bfloat16(sum * row_scale);
    return;
  }
  if (threadIdx.x < 16) part[((size_t)tile * splits + split) * 16 + threadIdx.x] = sum;
  __threadfence();  // the partials visible GPU-wide before the count says they are there
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counters + tile, 1) == splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (threadIdx.x < 16) {
    float total = 0.f;
    for (int v = 0; v < splits; ++v) total += __ldcg(part + ((size_t)tile * splits + v) * 16 + threadIdx.x);
    if (row0 + threadIdx.x < N) y[row0 + threadIdx.x] = __float2bfloat16(total * row_scale);
  }
  if (threadIdx.x == 0) counters[tile] = 0;
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, int warps, size_t smem, bool pdl, Args... args) {
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(warps * 32);
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

#define X_Q_S_M(x, q, scale, minimum) reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), q.data_ptr<uint8_t>(), \
  reinterpret_cast<const __half*>(scale.data_ptr()), reinterpret_cast<const __half*>(minimum.data_ptr())

void check_operands(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be one contiguous bf16 row");
  const int K = x.size(1);
  TORCH_CHECK(K % 128 == 0 && q.size(1) == K / 2 && scale.size(1) == K / 128 && scale.scalar_type() == torch::kHalf,
              "groups of 128 inputs, fp16 scales and minimums, two inputs a byte");
}

torch::Tensor mma_staged(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor minimum,
                         torch::Tensor part, torch::Tensor counters, int64_t warps, int64_t splits, bool pdl) {
  // int4 (q uint8 [N, K / 2], fp16 scale and minimum [N, K / 128]) or int8 (q int8 [N, K], fp32 scale [N], minimum
  // unused)
  const bool int8 = q.scalar_type() == torch::kChar;
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be one contiguous bf16 row");
  const int N = q.size(0), K = x.size(1), G = K / (int8 ? 64 : 128), tiles = (N + 15) / 16;
  if (int8) {
    TORCH_CHECK(K % 64 == 0 && q.size(1) == K && scale.scalar_type() == torch::kFloat && scale.numel() == N,
                "int8: weights [N, K], K a multiple of 64, one fp32 scale a row");
  } else {
    check_operands(x, q, scale);
  }
  TORCH_CHECK(splits >= 1 && splits <= G, "splits from 1 to the ", G, " groups, got ", splits);
  TORCH_CHECK(part.scalar_type() == torch::kFloat && part.numel() >= (int64_t)tiles * splits * 16 &&
              counters.scalar_type() == torch::kInt && counters.numel() >= tiles,
              "part: fp32 [tiles x splits x 16], counters: int32 zeros [tiles]");
  auto y = torch::empty({1, N}, x.options());
  const int most = (G + splits - 1) / splits;  // the largest share of groups
  const size_t smem = 16 * (most * 64 + 64) + (int8 ? 0 : 16 * most * 4) + 16 * most * 16 + warps * 16 * 4;
  #define S(W, I8) if (warps == W && int8 == I8) { launch(mma_gemv_staged<W, I8>, dim3(tiles, splits), W, smem, pdl, \
    reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), reinterpret_cast<const uint8_t*>(q.data_ptr()), \
    static_cast<const void*>(scale.data_ptr()), reinterpret_cast<const __half*>(minimum.data_ptr()), \
    reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), part.data_ptr<float>(), counters.data_ptr<int>(), N, K); return y; }
  S(2, false) S(4, false) S(8, false) S(2, true) S(4, true) S(8, true)
  #undef S
  TORCH_CHECK(false, "no instance for warps ", warps);
}

torch::Tensor int4_mma(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor minimum,
                       int64_t warps, int64_t in_flight, int64_t tiles, bool pdl) {
  check_operands(x, q, scale);
  const int N = q.size(0), K = x.size(1);
  auto y = torch::empty({1, N}, x.options());
  #define Q(W, F, T) if (warps == W && in_flight == F && tiles == T) { \
    launch(int4_mma_gemv<W, F, T>, dim3((N + 16 * T - 1) / (16 * T)), W, 0, pdl, X_Q_S_M(x, q, scale, minimum), \
           reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), N, K); return y; }
  Q(4, 4, 1) Q(8, 2, 1) Q(8, 2, 2)
  #undef Q
  TORCH_CHECK(false, "no instance for warps ", warps, ", in_flight ", in_flight, ", tiles ", tiles);
}
"""
CPP_DECLARATION = (
    "torch::Tensor int4_mma(torch::Tensor x, torch::Tensor q, torch::Tensor scale, "
    "torch::Tensor minimum, int64_t warps, int64_t in_flight, int64_t tiles, bool pdl);\n"
    "torch::Tensor mma_staged(torch::Tensor x, torch::Tensor q, torch::Tensor scale, "
    "torch::Tensor minimum, torch::Tensor part, torch::Tensor counters, int64_t warps, int64_t splits, "
    "bool pdl);"
)
SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
CONFIGS = [
    (4, 4, 1),
    (8, 2, 1),
    (8, 2, 2),
]  # q3: (warps, groups in flight a warp, tiles of 16 rows a warp)
STAGED = [(w, s) for w in (2, 4, 8) for s in (1, 2, 4, 8)]  # q4: (warps, splits of K)


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "forge_lab_int4_mma",
        cpp_sources=CPP_DECLARATION,
        cuda_sources=CUDA_SOURCE,
        functions=["int4_mma", "mma_staged"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
        verbose=False,
    )


def byte_perm(x: int, y: int, selector: int) -> int:
    "CUDA's __byte_perm: result byte n is byte (selector's nibble n) of the 8 bytes y:x (x's bytes 0-3, y's 4-7)."
    both = (y << 32) | x
    return sum(((both >> (8 * ((selector >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def a_pairs(w_lo: int, w_hi: int, mma: int) -> list[tuple[float, float]]:
    """The A registers a0..a3 of one mma (rows r, r + 8, r, r + 8) from word i of rows r (w_lo) and r + 8 (w_hi), as
    the BF16 pairs `nibble_pair` builds: bytes 0, 1 (mma 0) or 2, 3 (mma 1); their low nibbles, then the high ones."""

    def value(
        bits: int,
    ) -> tuple[float, float]:  # (bits & 0x000F000F) | 0x43004300 as two BF16: 128 + nibble
        return 128.0 + (bits & 0xF), 128.0 + ((bits >> 16) & 0xF)

    selector = 0x1100 if mma == 0 else 0x3322
    lo, hi = byte_perm(w_lo, 0, selector), byte_perm(w_hi, 0, selector)
    return [value(lo), value(hi), value(lo >> 4), value(hi >> 4)]


def b_pairs(
    xd: torch.Tensor, grp: int, t: int, i: int, mma: int, int8: bool = False
) -> tuple[tuple, tuple]:
    """The B registers b0, b1 of lane t's mma: x's words as they lie in memory, (k0, k0 + 1), and against the high
    nibbles the inputs 64 on (int4) or 16 x of the same inputs (int8)."""
    k0 = grp * (64 if int8 else 128) + 16 * t + 4 * i + 2 * mma
    if int8:
        return (xd[k0].item(), xd[k0 + 1].item()), (16 * xd[k0].item(), 16 * xd[k0 + 1].item())
    return (xd[k0].item(), xd[k0 + 1].item()), (xd[k0 + 64].item(), xd[k0 + 65].item())


def emulate(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None
) -> torch.Tensor:
    """The kernels' arithmetic in PyTorch (fp64), lane by lane and fragment by fragment: rows in tiles of 16, each
    group's 8 mma as m16n8k16 lays out its operands (A: a0 (r, 2t..2t+1), a1 (r + 8, 2t..), a2 (r, 2t + 8..),
    a3 (r + 8, 2t + 8..); B: b0 (k 2t..2t+1, column r), b1 (k 2t + 8.., column r); C: c0 (r, column 2t), c2 (r + 8,
    column 2t)). The group's Σx from mma with A all ones, as the kernels take it. int4 (q uint8 packed, scale and
    minimum a group) or int8 (q int8, a scale a row, `minimum` None: the bytes XOR 0x80). y [1, N], fp64."""
    int8 = q.dtype == torch.int8
    n, k = q.shape[0], x.shape[1]
    xd = x[0].double()
    words = q.contiguous().view(
        torch.int32
    )  # [N, bytes / 4]: little-endian, byte 0 in the low bits
    y = torch.zeros(n, dtype=torch.float64)
    for row0 in range(0, n, 16):
        for grp in range(
            k // (64 if int8 else 128)
        ):  # (the warp that takes it does not change the sums)
            c_tile, ones = (
                torch.zeros(16, 8, dtype=torch.float64),
                torch.zeros(16, 8, dtype=torch.float64),
            )
            for i in range(4):
                for mma in range(2):
                    A, B = (
                        torch.zeros(16, 16, dtype=torch.float64),
                        torch.zeros(16, 8, dtype=torch.float64),
                    )
                    for lane in range(32):
                        r, t = lane // 4, lane % 4
                        w_lo, w_hi = (
                            (int(words[min(row, n - 1), grp * 16 + t * 4 + i]) & 0xFFFFFFFF)
                            ^ (0x80808080 if int8 else 0)
                            for row in (row0 + r, row0 + r + 8)
                        )
                        for (ar, ac), pair in zip(
                            ((r, 2 * t), (r + 8, 2 * t), (r, 2 * t + 8), (r + 8, 2 * t + 8)),
                            a_pairs(w_lo, w_hi, mma),
                        ):
                            A[ar, ac], A[ar, ac + 1] = pair
                        b0, b1 = b_pairs(xd, grp, t, i, mma, int8)
                        B[2 * t, r], B[2 * t + 1, r] = b0
                        B[2 * t + 8, r], B[2 * t + 9, r] = b1
                    c_tile += A @ B
                    ones += torch.ones(16, 16, dtype=torch.float64) @ B
            xs = ones[0, 0]
            for rr in range(
                min(16, n - row0)
            ):  # c0 / c2: column 0 (every column holds the same sums)
                row = row0 + rr
                if int8:
                    y[row] += c_tile[rr, 0] - 2304 / 17 * xs
                else:
                    y[row] += (
                        scale[row, grp].double() * (c_tile[rr, 0] - 128 * xs)
                        + minimum[row, grp].double() * xs
                    )
    return y[None, :] * (scale.double()[None, :] if int8 else 1)


def check_emulation() -> bool:
    "emulate() against dequantize-and-multiply at a small shape (CPU, seconds), int4 and int8."
    gen = torch.Generator().manual_seed(0)
    n, k = 20, 256  # a partial second tile of rows, two int4 groups (four int8 ones)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(1, k, generator=gen).bfloat16()
    ok = True
    for name, quantized, dequantized in (
        ("int4", quantize_int4(w), dequantize_int4),
        ("int8", (*quantize_int8(w), None), dequantize_int8),
    ):
        want = F.linear(x.double(), dequantized(*[t for t in quantized if t is not None]).double())
        got = emulate(x, *quantized)
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(
            f"emulation of {name} against the dequantized matmul at {n} x {k}: relative error {err:.2e}"
        )
        ok &= err < 1e-6
    return ok


def check_staging() -> bool:
    """q4's shared-memory indexing, replayed in Python with the kernel's formulas: for every block (tile, split), the
    bytes its copy loop puts in `w_s` and `x_s` and what its warps then read back must be the global weight bytes,
    scales and x that q3 reads for the same row, group and lane; the splits must cover every group once."""
    import numpy as np

    ok = True
    for int8, n, k, splits in (
        (False, 40, 1152, 3),
        (True, 40, 1152, 5),
        (False, 2560, 9728, 4),
        (True, 24, 640, 1),
    ):
        inputs = 64 if int8 else 128
        groups, tiles = k // inputs, -(-n // 16)
        row_bytes = k if int8 else k // 2
        q = np.random.default_rng(0).integers(0, 256, (n, row_bytes), dtype=np.uint8)
        x_words = np.arange(
            k // 8
        )  # x as 16-byte words: each word's number stands for its contents
        covered = np.zeros(groups, dtype=int)
        for tile in range(tiles):
            for split in range(splits):
                g0 = split * groups // splits
                ng = (split + 1) * groups // splits - g0
                covered[g0 : g0 + ng] += tile == 0
                stride = ng * 64 + (0 if ng % 2 else 64)
                w_s = np.zeros(16 * stride, dtype=np.uint8)
                for c in range(16 * 4 * ng):  # the copy loop
                    r, j = c // (4 * ng), c % (4 * ng)
                    at = min(tile * 16 + r, n - 1) * row_bytes + g0 * 64 + j * 16
                    w_s[r * stride + j * 16 :][:16] = q.reshape(-1)[at : at + 16]
                x_s = np.full(16 * ng, -1)
                for c in range(ng * inputs // 8):
                    x_s[c] = x_words[g0 * inputs // 8 + c]
                for g in range(ng):  # what the warps read
                    for lane in range(32):
                        r, t = lane // 4, lane % 4
                        for rr in (r, r + 8):
                            row = min(tile * 16 + rr, n - 1)
                            got = w_s[rr * stride + g * 64 + t * 16 :][:16]
                            ok &= bool((got == q[row, (g0 + g) * 64 + t * 16 :][:16]).all())
                        first = (
                            g * (inputs // 8) + 2 * t
                        )  # xl: words of inputs (g0 + g) * inputs + 16t ..
                        ok &= bool(
                            (
                                x_s[first : first + 2]
                                == x_words[((g0 + g) * inputs + 16 * t) // 8 :][:2]
                            ).all()
                        )
                        if not int8:  # xh: the inputs 64 on
                            high = ((g0 + g) * 128 + 64 + 16 * t) // 8
                            ok &= bool(
                                (x_s[first + 8 : first + 10] == x_words[high : high + 2]).all()
                            )
                ok &= (
                    16 * stride % 64 == 0 and stride % 128 == 64
                )  # 16-byte aligned sections, conflict-free rows
        ok &= bool((covered == 1).all())
        print(
            f"q4 staging, {'int8' if int8 else 'int4'} {n} x {k} in {splits} splits: {'ok' if ok else 'WRONG'}"
        )
    return ok


def chain_ms(fn, matrices) -> float:
    "Median ms of one CUDA-graph replay of fn over the 36 matrices (each a distinct weight: nothing stays in L2)."
    from common import graphed_ms

    return graphed_ms(lambda: [fn(m) for m in matrices]) / len(matrices)


FORMATS = ("int4", "int8")


def quantized(fmt: str, n: int, k: int) -> tuple:
    "A random [n, k] weight in `fmt`, as `mma_staged` takes it: int4 (packed, scale, minimum); int8 (q, scale, scale)."
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    if fmt == "int4":
        return quantize_int4(w)
    q, scale = quantize_int8(w)
    return q, scale, scale  # (the third: the kernel's unused minimum)


def reference(fmt: str, x: torch.Tensor, mat: tuple) -> torch.Tensor:
    return F.linear(
        x.float(), dequantize_int4(*mat) if fmt == "int4" else dequantize_int8(*mat[:2])
    )


def exported(fmt: str, x: torch.Tensor, mat: tuple) -> torch.Tensor:
    "t0: chapter 10's Triton int4 GEMV, or chapter 09's GEMV with int8 weights."
    from forge_engine.kernels.gemv import gemv
    from forge_engine.quant.gemv import int4_gemv

    return int4_gemv(x, *mat) if fmt == "int4" else gemv(x, mat[0], None, mat[1], impl="triton")


def main():
    from common import ON_GPU, finish, validate

    if not ON_GPU:
        sys.exit("needs a GPU (and nvcc); `emulate` checks the index arithmetic on a CPU")
    formats = (sys.argv[1] if len(sys.argv) > 1 else "int4,int8").split(",")
    ext = build()
    ok = True
    for fmt in (
        formats
    ):  # q4 at a partial tile and uneven splits (int4: 9 groups, int8: 18), then o's shape
        for n, k in ((40, 1152), (2560, 4096)):
            x = torch.randn(1, k, device="cuda").bfloat16()
            mat = quantized(fmt, n, k)
            want = reference(fmt, x, mat)
            part, counters = staged_buffers(n)
            for warps, splits in STAGED:
                for call in range(2):  # the second call finds the counters back at zero
                    got = ext.mma_staged(x, *mat, part, counters, warps, splits, True).float()
                    ok &= validate(
                        f"{fmt} {n}x{k} q4-{warps}-{splits} call {call}", got, want, 2e-2
                    )
            ok &= bool((counters == 0).all())
    for fmt in formats:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(1, k, device="cuda").bfloat16()
            mats = [quantized(fmt, n, k) for _ in range(36)]
            want = reference(fmt, x, mats[0])
            ok &= validate(f"{fmt} {name} t0", exported(fmt, x, mats[0]).float(), want, 2e-2)
            t0 = chain_ms(lambda m: exported(fmt, x, m), mats)
            nbytes = sum(t.nbytes for t in mats[0][: 3 if fmt == "int4" else 2])
            print(
                f"{fmt} {name:8s} t0 (export)           {t0 * 1e3:7.2f} us a matrix, {nbytes / t0 / 1e9:5.2f} TB/s",
                flush=True,
            )
            for config in CONFIGS if fmt == "int4" else ():
                label = "q3-{}-{}-{}".format(*config)
                ok &= validate(
                    f"{fmt} {name} {label}",
                    ext.int4_mma(x, *mats[0], *config, True).float(),
                    want,
                    2e-2,
                )
                ms = chain_ms(lambda m: ext.int4_mma(x, *m, *config, True), mats)
                print(
                    f"{fmt} {name:8s} {label:22s} {ms * 1e3:7.2f} us a matrix, {nbytes / ms / 1e9:5.2f} TB/s",
                    flush=True,
                )
            part, counters = staged_buffers(n)
            for warps, splits in STAGED:
                label = f"q4-{warps}-{splits}"
                got = ext.mma_staged(x, *mats[0], part, counters, warps, splits, True).float()
                ok &= validate(f"{fmt} {name} {label}", got, want, 2e-2)
                ms = chain_ms(
                    lambda m: ext.mma_staged(x, *m, part, counters, warps, splits, True), mats
                )
                print(
                    f"{fmt} {name:8s} {label:22s} {ms * 1e3:7.2f} us a matrix, {nbytes / ms / 1e9:5.2f} TB/s",
                    flush=True,
                )
            del mats
            torch.cuda.empty_cache()
    finish(ok)


def staged_buffers(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    "q4's partial sums (fp32, for up to 8 splits of each 16-row tile) and its counters (int32 zeros, one a tile)."
    tiles = -(-n // 16)
    return torch.empty(tiles * 8 * 16, device="cuda"), torch.zeros(
        tiles, device="cuda", dtype=torch.int32
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["emulate"]:
        sys.exit(0 if check_emulation() & check_staging() else 1)
    main()
