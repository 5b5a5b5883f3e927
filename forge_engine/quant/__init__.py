"""Quantized weights: the int8 / int4 codes, the skinny matmul kernels and the int4 GEMV, GGUF blocks kept, and the layers that use them."""
