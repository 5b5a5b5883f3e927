"""The Triton kernels: which implementation runs (`backend`), the small fused kernels (`elementwise`), the GEMV for one to four rows (`gemv`), paged attention (`paged_attention`)."""
