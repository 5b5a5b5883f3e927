"""The LM head in int4: what its fewer bytes cost in quality.

Chapter 10's int8 and int4 modes keep the LM head (for a tied model also the embedding, the same table) in int8. An
int4 head reads half the bytes: `decode_overlap.py`'s "int4 head" variants measure the step with it (1.234 ms against
1.252 / 1.247 on an H200). This script measures the quality side on a CPU: SmolLM2-135M-Instruct's
perplexity on chapter 10's fixed text, its layers in int4, with the int8 head and with an int4 one.

    PYTHONPATH=.. python3 int4_head.py      (in kernels_lab/; FORGE_HOME holding smollm2-135m-instruct)
Measured: perplexity +7.52% with the int4 head against +0.67% with the int8 one, to save 18 µs a token: chapter 10
keeps the head in int8.
"""

import copy
import os
import re
from types import SimpleNamespace

import torch
import forge_engine.quant.layers as quant
from forge_engine.quant.formats import dequantize_int8
from forge_engine.loader import load_model

CHAPTER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "nbs", "_py", "10e_quant_layers.py"
)


def int4_head(model, group: int | None = None):
    """Lab-only: the model's int8 LM head re-quantized to int4, `group` inputs a scale (default: chapter 10's); a tied
    embedding then reads its rows from it."""
    head = model.lm_head
    weight = dequantize_int8(head.qweight, head.scale, torch.bfloat16)
    model.lm_head = quant.Int4Linear(SimpleNamespace(weight=weight), group=group)
    if isinstance(model.embed, quant.QuantEmbedding):
        model.embed = quant.QuantEmbedding(model.lm_head, model.embed.dtype)


def main():
    text = re.search(r'FIXED_TEXT = """(.*?)"""', open(CHAPTER).read(), re.S).group(
        1
    )  # chapter 10's fixed text
    smol = load_model("smollm2-135m-instruct", device="cpu", progress=False)
    ids = smol.tokenizer.encode(text)
    base = quant.perplexity(smol.model, ids)
    print(f"{len(ids)} tokens; unquantized perplexity {base:.3f}")
    for group in (None, 32):
        model = quant.quantize_model(copy.deepcopy(smol.model), "int4", int4_group=group)
        with_int8_head = quant.perplexity(model, ids)
        int4_head(model, group)
        with_int4_head = quant.perplexity(model, ids)
        print(
            f"int4 layers, groups of {group or 'default'}: int8 head {with_int8_head:.3f} "
            f"({100 * (with_int8_head / base - 1):+.2f}%), int4 head {with_int4_head:.3f} "
            f"({100 * (with_int4_head / base - 1):+.2f}%)"
        )


if __name__ == "__main__":
    main()
