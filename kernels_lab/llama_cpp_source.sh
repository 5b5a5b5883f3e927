#!/usr/bin/env bash
# llama.cpp's source for llama_cpp_cuda_peer.py's `llama` phase, small enough to carry to the GPU machine (which has
# no network): llama-cpp-python's source distribution carries llama.cpp under vendor/llama.cpp; without its docs,
# models, tests, examples, tools the peer does not build and other backends' sources it packs to ~6 MB.
#   bash kernels_lab/llama_cpp_source.sh DEST.tar.gz        (needs pip and a package index; ~1 minute)
set -euo pipefail
dest=$(realpath -m "${1:?usage: bash kernels_lab/llama_cpp_source.sh DEST.tar.gz}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work/dl"
tar xzf "$work"/dl/llama_cpp_python-*.tar.gz -C "$work"
cd "$work"/llama_cpp_python-*/vendor/llama.cpp
rm -rf docs models tests examples media benches ci pocs skills app tools/ui tools/server tools/cli
for backend in cann et hexagon hip metal musa opencl openvino sycl vulkan webgpu zdnn zendnn virtgpu; do
  rm -rf "ggml/src/ggml-$backend"
done
cd .. && tar czf "$dest" llama.cpp
echo "$dest: $(du -h "$dest" | cut -f1)"
