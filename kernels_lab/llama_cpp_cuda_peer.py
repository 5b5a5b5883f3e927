"""llama.cpp's CUDA build against forge-engine on the same GGUF files: Qwen3-4B's shape with random weights, batch 1
(llama-bench's tg128 and pp512 against `forge-engine bench w1 --quantization gguf`), and llama.cpp's aggregate at 16
sequences (llama-batched-bench). In two phases, so each fits one device call:

  llama   build llama.cpp from `--source` (a .tar.gz of its tree) with CUDA for the GPU at hand (llama-bench,
          llama-quantize, llama-batched-bench); write a random Qwen3-4B-shape checkpoint with transformers (bf16, on
          the GPU) and the Qwen3 tokenizer beside it; convert it with llama.cpp's own convert_hf_to_gguf.py to BF16,
          quantize that to Q8_0 and Q4_K_M; run llama-bench and llama-batched-bench on each file.
  forge   forge-engine's W1 on the files the llama phase left in --work, its prefill of 512 tokens and its decode
          rate at 16 sequences; and each file kept in its blocks against the same file dequantized to bf16 (the
          logits of one prompt).

Each phase writes its JSON to --out. The source: llama-cpp-python's source distribution carries llama.cpp under
`vendor/llama.cpp` (`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`); without its docs, models,
tests, examples and other backends' sources it packs to ~6 MB (`bash kernels_lab/llama_cpp_source.sh SRC.tar.gz` makes
it; carry its folder, git-ignored, to the GPU machine). The tokenizer: `forge-engine models pull
qwen3-tokenizer` and `qwen3-tokenizer-config` into $FORGE_HOME.

Run on the GPU machine from the repository root:
  PYTHONPATH=. python3 kernels_lab/llama_cpp_cuda_peer.py llama --source SRC.tar.gz --out $OUT
  PYTHONPATH=. python3 kernels_lab/llama_cpp_cuda_peer.py forge --out $OUT"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

FILES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}  # our name -> llama-quantize's type
TARGETS = ["llama-bench", "llama-quantize", "llama-batched-bench"]


def run(cmd: list[str], log: Path, **kw) -> float:
    "Run `cmd`, its output appended to `log`; seconds it took. Raises with the log's tail if it fails."
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        done = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, **kw)
    if done.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({done.returncode}):\n" + log.read_text()[-3000:])
    return time.perf_counter() - start


def build(source: Path, work: Path, log: Path) -> Path:
    "llama.cpp's tools, built with CUDA for this machine's GPU; their bin/ folder."
    tree = work / "llama.cpp"
    if not tree.exists():
        with tarfile.open(source) as tar:
            tar.extractall(work, filter="data")
    import torch

    major, minor = torch.cuda.get_device_capability()
    flags = [
        "-DGGML_CUDA=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={major}{minor}",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_APP=OFF",
    ]
    run(["cmake", "-S", tree, "-B", work / "build", "-G", "Ninja", *flags], log)
    run(["cmake", "--build", work / "build", "--target", *TARGETS, "-j", os.cpu_count()], log)
    return work / "build" / "bin"


def random_checkpoint(folder: Path) -> None:
    "A Qwen3-4B-shape checkpoint of random bf16 weights, written by transformers, the Qwen3 tokenizer beside it."
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from forge_engine.config import preset
    from forge_engine.model import hf_config_dict
    from forge_engine.registry import fetch

    config = Qwen3Config(**hf_config_dict(preset("qwen3-4b")))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    shutil.copy(fetch("qwen3-tokenizer"), folder / "tokenizer.json")
    shutil.copy(fetch("qwen3-tokenizer-config"), folder / "tokenizer_config.json")


def llama_phase(args, work: Path, log: Path) -> dict:
    seconds, start = {}, time.perf_counter()
    bin_dir = build(Path(args.source), work, log)
    seconds["build"] = time.perf_counter() - start
    hf = work / "hf"
    if not (work / "bf16.gguf").exists():
        start = time.perf_counter()
        random_checkpoint(hf)
        seconds["checkpoint"] = time.perf_counter() - start
        convert = work / "llama.cpp" / "convert_hf_to_gguf.py"
        seconds["convert"] = run(
            [sys.executable, convert, hf, "--outtype", "bf16", "--outfile", work / "bf16.gguf"],
            log,
            env={**os.environ, "PYTHONPATH": str(work / "llama.cpp" / "gguf-py")},
        )
        shutil.rmtree(hf)
    result = {"seconds": seconds, "files": {}}
    for name, qtype in FILES.items():
        path = work / f"{name}.gguf"
        if not path.exists():
            run([bin_dir / "llama-quantize", work / "bf16.gguf", path, qtype], log)
        bench = work / f"llama-bench-{name}.json"
        with open(bench, "w") as f:
            subprocess.run(
                [
                    bin_dir / "llama-bench",
                    "-m",
                    path,
                    "-p",
                    "512",
                    "-n",
                    "128",
                    "-ngl",
                    "99",
                    "-o",
                    "json",
                ],
                stdout=f,
                check=True,
            )
        batched = run(
            [bin_dir / "llama-batched-bench", "-m", path, "-c", "8192", "-b", "2048", "-ub", "512"]
            + ["-npp", "128", "-ntg", "128", "-npl", "1,16", "-ngl", "99"],
            work / f"batched-{name}.log",
        )
        result["files"][name] = {
            "bytes": path.stat().st_size,
            "llama_bench": json.loads(bench.read_text()),
            "batched_bench": (work / f"batched-{name}.log").read_text()[-2500:],
            "batched_seconds": batched,
        }
    return result


def agreement(path: Path) -> dict:
    """The file kept in its blocks (on a GPU: repacked into int8 and int4 planes, chapter 10g) against the same file dequantized
    to bf16 at load: the logits of a 64-token prompt, and which layer classes ran."""
    import torch

    from forge_engine.loader import load_model

    ids = torch.randint(0, 151936, (64,), generator=torch.Generator().manual_seed(0)).cuda()
    positions, logits, kinds = torch.arange(64, device="cuda"), {}, {}
    for quantization in ("gguf", "none"):
        model = load_model(str(path), "cuda", progress=False, quantization=quantization).model
        with torch.inference_mode():
            logits[quantization] = model.compute_logits(model(ids, positions)).float()
        kinds[quantization] = sorted({type(m).__name__ for m in model.layers.modules()})
        del model
        torch.cuda.empty_cache()
    kept, dense = logits["gguf"], logits["none"]
    return {
        "rel_logit_error": ((kept - dense).norm() / dense.norm()).item(),
        "argmax_agreement": (kept.argmax(-1) == dense.argmax(-1)).float().mean().item(),
        "layer_classes": kinds,
    }


def prefill_and_sixteen(path: Path) -> dict:
    """llama-bench's pp512 and llama-batched-bench's 16 sequences in forge-engine's engine, on the file kept in its
    blocks: one 512-token prompt to its first token (fresh ids each time: no cached prefix), the best of five; and 16
    prompts of 128 tokens with 128 new tokens each, the decode rate as llama-batched-bench counts it (S_TG: new tokens
    after the first over the time after the prompts, here the run to 129 tokens minus the run to 1)."""
    from forge_engine.bench import free_memory, random_prompts, run_batch
    from forge_engine.config import EngineConfig
    from forge_engine.engine import LLMEngine
    from forge_engine.loader import load_model
    from forge_engine.generate import SamplingParams

    engine = LLMEngine(
        load_model(str(path), "cuda", progress=False, quantization="gguf"), EngineConfig()
    )
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    run_batch(engine, random_prompts(2, 512, 512, seed=100), first)  # compile, capture
    prefill = [
        run_batch(engine, random_prompts(1, 512, 512, seed=s), first)["wall_s"] for s in range(5)
    ]
    prompts = random_prompts(16, 128, 128, seed=200)
    run_batch(
        engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )  # warm at 16 rows
    walls = {}
    for new in (1, 129):
        fresh = [[(t + new) % 10000 for t in p] for p in prompts]  # other ids: no cached prefix
        walls[new] = run_batch(
            engine, fresh, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        )["wall_s"]
    del engine
    free_memory()
    return {
        "pp512_tok_s": 512 / min(prefill),
        "sixteen_s_tg_tok_s": 16 * 128 / (walls[129] - walls[1]),
        "sixteen_walls_s": walls,
    }


def forge_phase(args, work: Path, log: Path) -> dict:
    result = {}
    for name in FILES:
        path, out = work / f"{name}.gguf", work / f"w1-{name}.json"
        cmd = [sys.executable, "-m", "forge_engine", "bench", "w1", "--model", path]
        run([*cmd, "--quantization", "gguf", "--json", out], log)
        w1 = json.loads(out.read_text())
        result[name] = {
            "decode_tok_s": w1["decode_tok_s"],
            "ttft_s": w1["ttft_s"],
            "w1": w1,
            "agreement": agreement(path),
            **prefill_and_sixteen(path),
        }
        print(name, {k: v for k, v in result[name].items() if k != "w1"}, flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["llama", "forge"])
    parser.add_argument("--source", help="llama.cpp's tree as a .tar.gz (the llama phase)")
    parser.add_argument("--work", default="/tmp/llama_cpp_peer", help="build folder and GGUF files")
    parser.add_argument("--out", default=".", help="where the phase's JSON and log go")
    args = parser.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    log = out / f"{args.phase}.log"
    phase = llama_phase if args.phase == "llama" else forge_phase
    result = phase(args, work, log)
    (out / f"{args.phase}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1)[:4000])


if __name__ == "__main__":
    main()
