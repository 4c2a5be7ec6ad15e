"""The Dev member's AR (Qwen3-VL-8B text decoder + generation experts): config, numerics, id mapping, loading.

References: bytedance/mammothmoda main, ``mamoda2/mammothmoda2/model/mammothmoda2_qwen3_vl/`` (QC = configuration,
QM = modeling) and ``../shared/reference/mammothmoda2-dev.md`` sections 1, 5, 7.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from ar_service.model.configuration import DEV_DEFAULT_CONDITION_LAYERS, ARConfig, ar_config_from_dict
from ar_service.model.loading import CheckpointMismatch, build_ar, build_random_ar, load_ar
from ar_service.model.modeling import (
    KVCache,
    MammothModa2AR,
    count_decode_parameters,
    count_parameters,
    mask_generation_vocab,
)
from ar_service.model.tiny import (
    TINY_DEV_CONDITION_LAYERS,
    dev_llm_config,
    preview_llm_config,
    tiny_dev_llm_config,
    tiny_dev_llm_parts,
    write_ar_only_root,
)
from servicekit.checkpoint import open_checkpoint, save_tensors


def _root(llm_config: dict, **extra) -> dict:
    return {"model_type": "mammothmoda2", "llm_config": llm_config, **extra}


def _tiny_dev_config(**text_changes) -> ARConfig:
    llm = copy.deepcopy(tiny_dev_llm_config())
    llm["text_config"].update(text_changes)
    return ar_config_from_dict(_root(llm, gen_condition_layers=list(TINY_DEV_CONDITION_LAYERS)))


# head_dim 32 (q_proj out 4 * 32 = 128, not hidden 64) with its own mrope_section.
HEAD_DIM_32 = {"head_dim": 32, "rope_scaling": {"mrope_section": [8, 4, 4], "mrope_interleaved": True}}


def _randomise_norms_(model: MammothModa2AR, seed: int = 3) -> MammothModa2AR:
    """Norm weights away from 1 (q/k norms strongly), so that a misplaced norm shows in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                scale = 0.3 if name.endswith(("q_norm.weight", "k_norm.weight")) else 0.05
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


@pytest.fixture(scope="module")
def dev_root(tmp_path_factory):
    return write_ar_only_root(tmp_path_factory.mktemp("dev") / "tiny-dev", dev=True)


@pytest.fixture(scope="module")
def dev_ar(dev_root):
    return load_ar(dev_root)


# -- config: the released classes' defaults, and validation ----------------------------------------------------------

def test_dev_config_takes_the_released_class_defaults():
    """A Dev llm_config that says almost nothing gets Mammothmoda2Qwen3VL{Text,}Config's defaults (QC:172-195, 274-286)."""
    config = ar_config_from_dict(_root({"model_type": "mammothmoda2_qwen3_vl", "text_config": {"rope_scaling": {}}}))
    assert config.member == "dev"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (151936, 4096, 22016, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 32, 128)
    assert (config.max_position_embeddings, config.rms_norm_eps, config.rope_theta) == (128000, 1e-6, 5e6)
    assert (config.gen_vocab_size, config.gen_vocab_start_index, config.moe_type) == (32800, 152064, "ffn")
    assert (config.image_token_id, config.video_token_id) == (151655, 151656)
    assert (config.vision_start_token_id, config.vision_end_token_id) == (151652, 151653)
    assert config.attention_bias is False and config.o_proj_bias is False and config.qk_norm is True
    assert config.mrope_section == (24, 20, 20) and config.mrope_interleaved  # QM:306's default section
    assert config.condition_layers == DEV_DEFAULT_CONDITION_LAYERS == (-2, -5, -8, -11, -14, -17)
    assert config.final_hidden_normed is False and config.text_condition_with_answer is False
    assert config.gen_logit_start == 151936 and config.gen_id_range == range(152064, 151936 + 32800)


def test_llm_level_generation_fields_fill_only_what_text_config_lacks():
    """QC:294-305: llm_config's extra_gen_vocab / gen_vocab_size / gen_vocab_start_index / moe_type are copied down
    only where text_config lacks them."""
    llm = copy.deepcopy(tiny_dev_llm_config())
    llm["moe_type"] = "ffn-0:1"
    assert ar_config_from_dict(_root(llm, gen_condition_layers=[-2])).moe_type == "ffn-2:4"  # the text config wins
    del llm["text_config"]["moe_type"]
    assert ar_config_from_dict(_root(llm, gen_condition_layers=[-2])).moe_type == "ffn-0:1"


def test_dev_condition_layers_default_and_tuple_semantics():
    """C:65 ``gen_condition_layers or [-2, ...]``: absent and [] both give the default; at N = 36 it reads the outputs
    of layers 34, 31, 28, 25, 22, 19 (tuple entry k = output of layer k - 1), all un-normed."""
    llm = dev_llm_config()
    for root in (_root(llm), _root(llm, gen_condition_layers=[]), _root(llm, gen_condition_layers=None)):
        config = ar_config_from_dict(root)
        assert config.condition_layers == DEV_DEFAULT_CONDITION_LAYERS
    assert config.num_hidden_layers == 36 and not config.final_hidden_normed
    assert [k - 1 for k in config.condition_tuple_indices] == [34, 31, 28, 25, 22, 19]
    assert ar_config_from_dict(_root(llm, gen_condition_layers=[-1, 0])).condition_tuple_indices == (36, 0)
    preview = ar_config_from_dict(_root(preview_llm_config()))
    assert preview.condition_layers is None and preview.final_hidden_normed
    with pytest.raises(ValueError, match="outside"):  # the default list needs 17+ layers
        ar_config_from_dict(_root(tiny_dev_llm_config()))


def test_text_condition_with_answer_is_parsed():
    assert ar_config_from_dict(_root(dev_llm_config(), gen_text_condition_with_answer=True)).text_condition_with_answer
    assert not ar_config_from_dict(_root(dev_llm_config())).text_condition_with_answer
    with pytest.raises(ValueError, match="gen_text_condition_with_answer"):
        ar_config_from_dict(_root(dev_llm_config(), gen_text_condition_with_answer="yes"))


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        (None, "must be a dict"),
        ([24, 20, 20], "must be a dict"),
        ({"mrope_section": [4, 2, 1]}, "summing to head_dim / 2 = 8"),
        ({"mrope_section": [4, 4]}, "3 non-negative numbers"),
        ({"mrope_section": [1, 4, 3]}, "interleaved MRoPE needs"),  # sums to 8, but H would need indices up to 12
        ({"mrope_section": "4,2,2"}, "list of 3 integers"),
        ({}, "summing to head_dim / 2 = 8"),  # the released default [24, 20, 20] is for head_dim 128
        ({"rope_type": "yarn", "mrope_section": [4, 2, 2]}, "rope type 'yarn'"),
    ],
)
def test_bad_rope_scaling_is_refused(rope_scaling, message):
    llm = copy.deepcopy(tiny_dev_llm_config())
    llm["text_config"]["rope_scaling"] = rope_scaling
    with pytest.raises(ValueError, match=message):
        ar_config_from_dict(_root(llm, gen_condition_layers=[-2]))


def test_rope_parameters_and_theta():
    llm = copy.deepcopy(tiny_dev_llm_config())
    text = llm["text_config"]
    del text["rope_theta"]
    assert ar_config_from_dict(_root(llm, gen_condition_layers=[-2])).rope_theta == 5e6  # Dev's default
    # transformers 5 writes rope_scaling + rope_theta as rope_parameters
    text["rope_parameters"] = dict(text.pop("rope_scaling"), rope_theta=1234.0)
    config = ar_config_from_dict(_root(llm, gen_condition_layers=[-2]))
    assert config.rope_theta == 1234.0 and config.mrope_section == (4, 2, 2)


def test_bias_options_and_module_shapes():
    dev = build_ar(_tiny_dev_config(**HEAD_DIM_32))  # meta: q_proj out 4 * 32 = 128 != hidden 64
    attn = dev.model.language_model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (128, 64) and attn.k_proj.weight.shape == (64, 64) and attn.o_proj.weight.shape == (64, 128)
    assert all(getattr(attn, f"{p}_proj").bias is None for p in "qkvo")
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (32,)
    biased = build_ar(_tiny_dev_config(attention_bias=True)).model.language_model.layers[0].self_attn
    assert all(getattr(biased, f"{p}_proj").bias is not None for p in "qkvo")  # QM:480-491: o too
    preview = build_ar(ar_config_from_dict(_root(preview_llm_config()))).model.language_model.layers[0].self_attn
    assert all(getattr(preview, f"{p}_proj").bias is not None for p in "qkv") and preview.o_proj.bias is None
    assert not hasattr(preview, "q_norm") and not hasattr(preview, "k_norm")
    with pytest.raises(ValueError, match="attention_bias must be true or false"):
        _tiny_dev_config(attention_bias="false")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        _tiny_dev_config(tie_word_embeddings=True)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        _tiny_dev_config(num_key_value_heads=3)


def test_attention_experts_are_ignored_on_dev(caplog):
    """QM:567: the Dev layer asks moe_enable about "ffn" only; an "attention" part builds nothing (logged)."""
    with caplog.at_level(logging.WARNING, logger="ar_service.model.configuration"):
        config = _tiny_dev_config(moe_type="ffn_attention-2:4")
    assert "FFN experts only" in caplog.text
    assert config.moe.layers(4, "ffn") == [2, 3] and config.moe.layers(4, "attention") == []
    names = set(build_ar(config).state_dict())
    assert not any("gen_q_proj" in n or "gen_o_proj" in n for n in names)
    assert not any("gen_mlp" in n for n in build_ar(_tiny_dev_config(moe_type="attention")).state_dict())
    preview_llm = copy.deepcopy(preview_llm_config())
    preview_llm["text_config"]["moe_type"] = "ffn_attention-14:28"
    assert ar_config_from_dict(_root(preview_llm)).moe.layers(28, "attention") == list(range(14, 28))


def test_parameter_counts_match_the_modules():
    for config in (_tiny_dev_config(), _tiny_dev_config(**HEAD_DIM_32, attention_bias=True),
                   ar_config_from_dict(_root(dev_llm_config()))):
        model = build_ar(config)  # meta device: nothing allocated
        assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())
    dev = ar_config_from_dict(_root(dev_llm_config()))
    counts = count_parameters(dev)
    assert counts["experts"] == 20 * 3 * 4096 * 12288  # ffn-16:36
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert count_decode_parameters(dev) == 36 * layer + 4096 + 32800 * 4096


# -- numerics: a plain reading of the released formulas ---------------------------------------------------------------

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3VLTextRMSNorm (QM:356-361)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _reference_forward(state: dict[str, torch.Tensor], config: ARConfig, ids: torch.Tensor):
    """The released Dev AR on one prompt (text positions 0..T-1 on all three MRoPE axes), written from QM:
    returns (logits [T, V_text + V_gen], the hidden-states tuple as check_model_inputs records it)."""
    lm = "model.language_model."
    start, eps = config.gen_vocab_start_index, config.rms_norm_eps
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    ids = ids[0]
    t = ids.shape[0]
    gen = ids >= start  # QM:919
    x = torch.stack([state[f"{lm}gen_embed_tokens.weight"][i - start] if g else state[f"{lm}embed_tokens.weight"][i]
                     for i, g in zip(ids.tolist(), gen.tolist(), strict=True)])
    # Interleaved MRoPE with equal T/H/W positions (QM:308-344): build all three axes and interleave, as released.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(t).float()
    freqs = torch.stack([pos[:, None] * inv_freq[None, :]] * 3)  # (3, T, d/2)
    mixed = freqs[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        idx = slice(offset, config.mrope_section[axis] * 3, 3)
        mixed[:, idx] = freqs[axis][:, idx]
    emb = torch.cat([mixed, mixed], dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rot(v):  # rotate_half (QM:367-391)
        return torch.cat([-v[..., d // 2:], v[..., : d // 2]], dim=-1)

    states = [x]
    for i in range(config.num_hidden_layers):
        p = f"{lm}layers.{i}."
        h = _rms(x, state[f"{p}input_layernorm.weight"], eps)
        q = (h @ state[f"{p}self_attn.q_proj.weight"].T).view(t, heads, d)
        k = (h @ state[f"{p}self_attn.k_proj.weight"].T).view(t, kv_heads, d)
        v = (h @ state[f"{p}self_attn.v_proj.weight"].T).view(t, kv_heads, d)
        q = _rms(q, state[f"{p}self_attn.q_norm.weight"], eps).transpose(0, 1)  # norm per head, then RoPE
        k = _rms(k, state[f"{p}self_attn.k_norm.weight"], eps).transpose(0, 1)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=0)  # GQA (repeat_kv)
        v = v.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        scores = q @ k.transpose(1, 2) * d**-0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, heads * d)
        x = x + attn @ state[f"{p}self_attn.o_proj.weight"].T
        h = _rms(x, state[f"{p}post_attention_layernorm.weight"], eps)
        expert = config.moe.enabled("ffn", i)
        out = []
        for row, g in zip(h, gen.tolist(), strict=True):  # moe_forward: hard routing by token id (QM:409-464)
            m = f"{p}gen_mlp." if expert and g else f"{p}mlp."
            up = row @ state[f"{m}up_proj.weight"].T
            out.append((F.silu(row @ state[f"{m}gate_proj.weight"].T) * up) @ state[f"{m}down_proj.weight"].T)
        x = x + torch.stack(out)
        states.append(x)  # the output of layer i (captured by check_model_inputs, not normed at the end)
    final = _rms(x, state[f"{lm}norm.weight"], eps)
    logits = torch.cat([final @ state["lm_head.weight"].T, final @ state["gen_head.weight"].T], dim=-1)  # QM:1522-1527
    return logits, states


def test_dev_ar_matches_the_released_formulas():
    """Whole tiny Dev AR (explicit head_dim 32 != hidden / heads, GQA 4 / 2, q/k norms, theta 5e6, experts on layers
    2-3, a prompt mixing text and generation ids) against the plain reading above; also the condition mean."""
    config = _tiny_dev_config(**HEAD_DIM_32)
    model = _randomise_norms_(build_random_ar(config, "cpu", torch.float32, seed=5))
    ids = torch.tensor([[3, 100, 7, 512, 519, 530, 583, 40, 520]])
    state = model.state_dict()
    with torch.no_grad():
        logits, condition = model(ids)
        want_logits, states = _reference_forward(state, config, ids)
    torch.testing.assert_close(logits[0], want_logits, rtol=1e-4, atol=1e-4)
    want = torch.stack([states[i] for i in TINY_DEV_CONDITION_LAYERS]).mean(0)
    torch.testing.assert_close(condition[0], want, rtol=1e-4, atol=1e-5)


def test_dev_layer_matches_transformers_qwen3_vl():
    """Our decoder layer and RoPE against transformers' own Qwen3VLTextDecoderLayer / Qwen3VLTextRotaryEmbedding, weights
    copied in, text positions (all three MRoPE axes equal); an expert layer fed only generation ids against the same
    class with gen_mlp's weights as its mlp."""
    qwen3_vl = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig

    config = _tiny_dev_config(**HEAD_DIM_32)
    model = _randomise_norms_(build_random_ar(config, "cpu", torch.float32, seed=7))
    hf_config = Qwen3VLTextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta, "mrope_section": [8, 4, 4],
                         "mrope_interleaved": True},
    )
    hf_config._attn_implementation = "sdpa"  # no mask + sdpa = causal
    lm = model.model.language_model
    for layer_idx, ids in ((0, [[3, 100, 7, 40, 9, 200]]), (2, [[512, 519, 530, 583, 520, 560]])):
        ids_t = torch.tensor(ids)
        positions = torch.arange(ids_t.shape[1])[None]
        with torch.no_grad():
            x, route, is_gen, cos, sin = lm._inputs(ids_t, positions)
            hf_cos, hf_sin = qwen3_vl.Qwen3VLTextRotaryEmbedding(hf_config)(x, positions[None].expand(3, 1, -1))
            torch.testing.assert_close(cos[:, 0], hf_cos, rtol=0, atol=0)
            torch.testing.assert_close(sin[:, 0], hf_sin, rtol=0, atol=0)
            ours = lm.layers[layer_idx]
            hf_layer = qwen3_vl.Qwen3VLTextDecoderLayer(hf_config, layer_idx).eval()
            weights = {k: v for k, v in ours.state_dict().items() if not k.startswith(("mlp.", "gen_mlp."))}
            mlp = "gen_mlp." if route == "gen" else "mlp."
            weights.update({f"mlp.{k[len(mlp):]}": v for k, v in ours.state_dict().items() if k.startswith(mlp)})
            hf_layer.load_state_dict(weights, strict=True)
            got = ours(x, cos, sin, route, is_gen, None)
            want = hf_layer(x, position_embeddings=(hf_cos, hf_sin), attention_mask=None)
        assert route == ("text" if layer_idx == 0 else "gen")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_norms_are_applied_before_rope_and_per_head(dev_ar):
    """The tiny Dev weights make a misplaced q/k norm visible: swapping q_norm and k_norm, or dropping them, changes
    the logits."""
    ids = torch.tensor([[3, 100, 512, 530, 583]])
    model = dev_ar.model
    with torch.no_grad():
        logits, _ = model(ids)
        swapped = copy.deepcopy(model)
        for layer in swapped.model.language_model.layers:
            q, k = layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight
            q.data, k.data = k.data.clone(), q.data.clone()
        assert not torch.allclose(swapped(ids)[0], logits, atol=1e-4)
        plain = copy.deepcopy(model)
        for layer in plain.model.language_model.layers:
            layer.self_attn.qk_norm = False
        assert not torch.allclose(plain(ids)[0], logits, atol=1e-4)


# -- hidden-states tuple: Dev's last entry is not normed --------------------------------------------------------------

def test_dev_tuple_last_entry_is_the_raw_output(dev_ar):
    """Entry 0 = embeddings, entry k = output of layer k - 1; entry N (index -1) is layer N-1's output, NOT the final
    norm (Preview's tuple ends with the normed state: tests/ar_service/test_ar_model.py)."""
    ids = torch.tensor([[5, 9, 520, 530]])
    lm = dev_ar.model.model.language_model
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone())) for layer in lm.layers]
    hooks.append(lm.layers[-1].register_forward_hook(lambda m, args, out: seen.append(out.clone())))
    with torch.no_grad():
        logits, normed = dev_ar.model(ids)  # the tiny root's TINY_DEV_CONDITION_LAYERS
    for h in hooks:
        h.remove()
    states = seen  # N + 1 = 5 entries
    torch.testing.assert_close(normed, torch.stack([states[i] for i in TINY_DEV_CONDITION_LAYERS]).mean(0))
    for layers in ([-1], [0, -1], [-2, -3, -5], [4], [3]):
        config = dataclasses.replace(dev_ar.config, condition_layers=tuple(layers))
        model = build_random_ar(config, "cpu", torch.float32)
        model.load_state_dict(dev_ar.model.state_dict())
        with torch.no_grad():
            got_logits, got = model(ids)
        torch.testing.assert_close(got, torch.stack([states[i] for i in layers]).mean(0))
        torch.testing.assert_close(got_logits, logits)
    final_normed = lm.norm(states[-1])
    assert not torch.allclose(final_normed, states[-1], atol=1e-3)  # so the -1 check above means something


def test_dev_decode_matches_forward(dev_ar):
    """Cached prefill + one-token decode steps give the full forward's logits and condition states."""
    ids = torch.tensor([[1, 2, 3, 4, 517, 512, 530, 575]])
    model = dev_ar.model
    with torch.no_grad():
        full_logits, full = model(ids)
        cache = KVCache()
        model(ids[:, :5], cache=cache)
        for i in range(5, 8):
            gen_logits, condition = model.decode([int(ids[0, i])], [i], [cache], pad_to=2)
            torch.testing.assert_close(condition[0], full[0, i], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gen_logits[0], full_logits[0, i, model.config.gen_logit_start:], rtol=1e-5, atol=1e-5)


# -- the skewed id mapping (vocab_size != gen_vocab_start_index) -------------------------------------------------------

def test_skew_maps_columns_ids_and_embedding_rows_as_released():
    """vocab_size 504 = gen_vocab_start_index 512 - 8 (Qwen3-VL's 151936 vs 152064, scaled down): gen_head column c is
    token id 504 + c (the sampled logit index is the id), embedded as gen row id - 512 and routed to the experts from
    512; ids 504..511 route as text with no embedding row (the released lookup fails there too)."""
    config = _tiny_dev_config(vocab_size=504)
    assert (config.vocab_size, config.gen_vocab_start_index, config.gen_logit_start) == (504, 512, 504)
    assert config.total_vocab_size == 504 + 72 and config.gen_id_range == range(512, 576)
    assert config.gen_column_id(20) == 524 and config.gen_embedding_row(524) == 12
    model = _randomise_norms_(build_random_ar(config, "cpu", torch.float32, seed=9))
    lm = model.model.language_model
    assert lm.embed_tokens.weight.shape[0] == 504 and model.lm_head.weight.shape[0] == 504
    ids = torch.tensor([[3, 100, 524, 512, 575]])
    positions = torch.arange(5)[None]
    with torch.no_grad():
        x, route, is_gen, _, _ = lm._inputs(ids, positions)
        assert route == "mixed" and is_gen.tolist() == [[False, False, True, True, True]]
        torch.testing.assert_close(x[0, 2], lm.gen_embed_tokens.weight[12])
        torch.testing.assert_close(x[0, 3], lm.gen_embed_tokens.weight[0])
        torch.testing.assert_close(x[0, 4], lm.gen_embed_tokens.weight[63])
        torch.testing.assert_close(x[0, 1], lm.embed_tokens.weight[100])
        logits, _ = model(ids)
        assert logits.shape[-1] == 576
        gen = model.gen_head(lm.norm(_last_hidden(model, ids)))
        torch.testing.assert_close(logits[0, -1, 504 + 20], gen[0, -1, 20].float())  # column 524 = gen column 20
        cache = KVCache()
        model(ids[:, :4], cache=cache)
        gen_logits, _ = model.decode([575], [4], [cache])
        torch.testing.assert_close(gen_logits[0], logits[0, -1, 504:], rtol=1e-5, atol=1e-5)
        masked = mask_generation_vocab(logits.clone(), config.gen_logit_start, t2i=False)
        assert torch.isinf(masked[..., 504:]).all() and torch.isfinite(masked[..., :504]).all()
        with pytest.raises(ValueError, match=r"token ids in \[504, 512\) have no embedding row.*\[508\]"):
            model(torch.tensor([[3, 508, 520]]))


def _last_hidden(model: MammothModa2AR, ids: torch.Tensor) -> torch.Tensor:
    out = []
    hook = model.model.language_model.layers[-1].register_forward_hook(lambda m, args, o: out.append(o))
    model(ids)
    hook.remove()
    return out[0]


def test_preview_still_refuses_a_skew():
    llm = copy.deepcopy(preview_llm_config())
    llm["text_config"]["vocab_size"] = 151936
    with pytest.raises(ValueError, match="must equal the text vocab_size"):
        ar_config_from_dict(_root(llm))


# -- the tiny Dev checkpoint through the loader -----------------------------------------------------------------------

def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_tiny_dev_root_is_deterministic(tmp_path, dev_root):
    assert _digest(dev_root) == _digest(write_ar_only_root(tmp_path / "again", dev=True))
    _, a = tiny_dev_llm_parts()
    _, b = tiny_dev_llm_parts()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_dev_loads_strictly_with_the_written_weights(dev_root, dev_ar, caplog):
    assert dev_ar.config.member == "dev" and dev_ar.config.condition_layers == TINY_DEV_CONDITION_LAYERS
    _, tensors = tiny_dev_llm_parts()
    expected = {k[len("llm_model."):]: v for k, v in tensors.items()
                if k.startswith("llm_model.") and not k.startswith("llm_model.model.visual.")}
    state = dev_ar.model.state_dict()
    assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    lm = "model.language_model.layers."
    assert {f"{lm}0.self_attn.q_norm.weight", f"{lm}3.self_attn.k_norm.weight", f"{lm}2.gen_mlp.up_proj.weight"} <= set(state)
    assert not any(n.endswith("_proj.bias") for n in state) and f"{lm}1.gen_mlp.up_proj.weight" not in state
    names = open_checkpoint(dev_root).tensor_names()
    vision = sum(n.startswith("llm_model.model.visual.") for n in names)
    mammothtok = sum(n.startswith("gen_tokenizer.") for n in names)
    assert mammothtok and any(n.startswith("llm_model.model.visual.deepstack") for n in names)
    with caplog.at_level(logging.INFO, logger="ar_service.model.loading"):
        load_ar(dev_root)
    assert f"not loading {vision} vision-tower tensors" in caplog.text
    assert f"not loading {mammothtok} tensors under gen_tokenizer." in caplog.text


def _rewrite(root, change):
    tensors = open_checkpoint(root).load_tensors("")
    change(tensors)
    (root / "model.safetensors").unlink()
    save_tensors(root, tensors)


def test_missing_q_norm_fails_naming_it(tmp_path, dev_root):
    root = shutil.copytree(dev_root, tmp_path / "missing")
    _rewrite(root, lambda t: t.pop("llm_model.model.language_model.layers.1.self_attn.q_norm.weight"))
    with pytest.raises(CheckpointMismatch, match=r"missing 1: model\.language_model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_ar(root)


def test_preview_bias_in_a_dev_checkpoint_fails_naming_it(tmp_path, dev_root):
    root = shutil.copytree(dev_root, tmp_path / "bias")
    _rewrite(root, lambda t: t.update({"llm_model.model.language_model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointMismatch, match=r"unexpected 1: model\.language_model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_ar(root)


def test_dev_shapes_random_build_on_meta():
    """The Dev shapes for the GPU bench: 36 layers, head_dim 128, 8 kv heads; 8.19B dense (Qwen3-VL-8B's text decoder,
    untied heads), 3.02B experts, 0.27B generation embedding + head."""
    config = ar_config_from_dict(_root(dev_llm_config()))
    counts = count_parameters(config)
    assert (counts["dense"], counts["experts"], counts["gen_vocab"]) == (8_190_735_360, 3_019_898_880, 268_697_600)
    model = build_ar(config)
    assert model.lm_head.weight.shape == (151936, 4096) and model.gen_head.weight.shape == (32800, 4096)
    attn = model.model.language_model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4096, 4096) and attn.k_proj.weight.shape == (1024, 4096)
    assert math.isclose(config.rope_theta, 5e6) and config.mrope_section == (24, 20, 20)
