"""FP8 weight-only quantization of the AR, done at load time from the bf16 checkpoint (no new checkpoint format).

What is quantized: every decoder layer's linear layers (text and expert copies: q/k/v/o, gate/up/down) and the
generation head, which a decode token reads (the text-to-image decode path reads ~7 B of these weights per token;
in e4m3 that is half the bytes of bf16). What stays bf16: the embeddings (a gather of one row per token: nothing
to gain), the RMSNorm weights and q/k/v biases (tiny), and the text head ``lm_head`` (only prefill's last position
reads it, for non-image requests, so quantizing it would buy memory, not speed, at the cost of text logits).

Activations stay bf16 everywhere (weight-only): the decode kernels read fp8 weight tiles and scale the float32
accumulator per output channel (``decode_kernels.linear``'s ``scale``); prefill and the eager paths dequantize a
layer's weight for its matmul (``servicekit.fp8.FP8Linear`` "weight_only"; on CUDA one pass of
``servicekit.fp8_kernels.dequantize`` per weight), so prefill and decode see the same quantized weights.
"""

from __future__ import annotations

from ar_service.model.modeling import MammothModa2AR
from servicekit.fp8 import quantize_linears_
from servicekit.fp8_kernels import dequantize

#: Names of the AR linear layers FP8 covers, relative to a decoder layer.
LAYER_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.gen_q_proj", "self_attn.gen_k_proj", "self_attn.gen_v_proj", "self_attn.gen_o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "gen_mlp.gate_proj", "gen_mlp.up_proj", "gen_mlp.down_proj",
)


def fp8_linear_names(model: MammothModa2AR) -> list[str]:
    """Dotted names of the linears ``quantize_ar_`` replaces (those the model has: experts only where configured)."""
    present = {name for name, _ in model.named_modules()}
    names = [f"model.language_model.layers.{i}.{leaf}" for i in range(len(model.model.language_model.layers))
             for leaf in LAYER_LINEARS]
    return [name for name in names if name in present] + ["gen_head"]


def quantize_ar_(model: MammothModa2AR) -> MammothModa2AR:
    """Replaces the AR's decode-path linears by weight-only FP8 ones, in place (one layer at a time)."""
    quantize_linears_(model, fp8_linear_names(model), "weight_only", dequantize=dequantize)
    return model
