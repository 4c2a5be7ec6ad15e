import dataclasses
import hashlib
import json
import shutil

import pytest
import torch

from ar_service.model.configuration import ar_config_from_dict, parse_moe_type
from ar_service.model.loading import CheckpointMismatch, build_ar, build_random_ar, load_ar
from ar_service.model.modeling import KVCache, MammothModa2AR, count_parameters, mask_generation_vocab
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.model.tiny import (
    PREVIEW_T2I,
    preview_llm_config,
    tiny_llm_config,
    tiny_llm_parts,
    write_ar_only_root,
)
from servicekit.checkpoint import open_checkpoint, save_tensors


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _copy_root(src, dst):
    shutil.copytree(src, dst)
    return dst


# -- layout and determinism -------------------------------------------------------------------

def test_tiny_root_is_deterministic_and_small(tmp_path, tiny_root):
    again = write_ar_only_root(tmp_path / "again")
    assert _digest(tiny_root) == _digest(again)
    assert {"config.json", "model.safetensors", "tokenizer.json", "t2i_generation_config.json"} <= set(_digest(again))
    assert sum(p.stat().st_size for p in tiny_root.iterdir()) < 5_000_000


def test_tiny_uses_upstream_names(tiny_root):
    config = json.loads((tiny_root / "config.json").read_text())
    llm = config["llm_config"]
    assert config["model_type"] == "mammothmoda2" and llm["model_type"] == "mammothmoda2_qwen2_5_vl"
    assert llm["text_config"]["moe_type"] == "ffn-1:2" and llm["gen_vocab_size"] == 72
    names = set(open_checkpoint(tiny_root).tensor_names("llm_model."))
    lm = "llm_model.model.language_model."
    for name in (
        f"{lm}embed_tokens.weight",
        f"{lm}gen_embed_tokens.weight",
        f"{lm}norm.weight",
        f"{lm}layers.0.self_attn.q_proj.bias",
        f"{lm}layers.0.self_attn.k_proj.bias",
        f"{lm}layers.0.self_attn.v_proj.bias",
        f"{lm}layers.0.self_attn.o_proj.weight",
        f"{lm}layers.0.mlp.gate_proj.weight",
        f"{lm}layers.1.gen_mlp.down_proj.weight",
        f"{lm}layers.1.input_layernorm.weight",
        f"{lm}layers.1.post_attention_layernorm.weight",
        "llm_model.lm_head.weight",
        "llm_model.gen_head.weight",
        "llm_model.model.visual.patch_embed.proj.weight",
    ):
        assert name in names, name
    assert f"{lm}layers.0.gen_mlp.gate_proj.weight" not in names  # "ffn-1:2": layer 1 only
    assert f"{lm}layers.0.self_attn.o_proj.bias" not in names
    assert not any("gen_q_proj" in n for n in names)  # ffn experts only


def test_tokenizer_special_ids(tiny_ar):
    tok, cfg, t2i = tiny_ar.tokenizer, tiny_ar.config, tiny_ar.t2i
    start = cfg.gen_vocab_start_index
    assert (cfg.vocab_size, cfg.gen_vocab_size, start, len(tok)) == (512, 72, 512, 584)
    ids = tok.convert_tokens_to_ids
    header = ["<|endofline|>", "<|endoffile|>", "<|gen_placeholder|>", "<|useless token|>", "<|beginoftext|>",
              "<|image start|>", "<|image token|>", "<|image end|>"]
    assert [ids(t) for t in header] == list(range(start, start + 8))
    assert (ids("<|visual token 0|>"), ids("<|visual token 63|>")) == (start + 8, start + 71)
    assert (t2i.eol_token_id, t2i.visual_token_start_id, t2i.visual_token_end_id) == (start, start + 8, start + 72)
    assert (cfg.image_token_id, cfg.video_token_id) == (ids("<|image_pad|>"), ids("<|video_pad|>"))
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id) == (ids("<|vision_start|>"), ids("<|vision_end|>"))
    encoded = tok("<|image start|>16*16<|image token|>", add_special_tokens=False)["input_ids"]
    digits = tok.convert_tokens_to_ids(["1", "6", "*", "1", "6"])
    assert encoded == [start + 5, *digits, start + 6] and all(d < start for d in digits)


def test_any_text_round_trips(tiny_ar):
    text = "Ünïcode 🦊 prompt\twith <tags> & 1234"
    ids = tiny_ar.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert all(i < 512 for i in ids) and tiny_ar.tokenizer.decode(ids) == text


# -- strict loading ---------------------------------------------------------------------------

def test_load_gives_the_written_weights(tiny_ar):
    _, tensors = tiny_llm_parts()
    state = tiny_ar.model.state_dict()
    expected = {k[len("llm_model."):]: v for k, v in tensors.items() if not k.startswith("llm_model.model.visual.")}
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    logits, hidden = tiny_ar.model(torch.tensor([[3, 100, 512, 525, 583]]))
    assert logits.shape == (1, 5, 584) and logits.dtype == torch.float32 and hidden.shape == (1, 5, 64)


def _rewrite_weights(root, change):
    tensors = open_checkpoint(root).load_tensors("")
    change(tensors)
    (root / "model.safetensors").unlink()
    save_tensors(root, tensors)


def test_extra_tensor_fails_naming_it(tmp_path, tiny_root):
    root = _copy_root(tiny_root, tmp_path / "extra")
    _rewrite_weights(root, lambda t: t.update({"llm_model.model.language_model.layers.0.gen_mlp.up_proj.weight": torch.zeros(128, 64)}))
    with pytest.raises(CheckpointMismatch, match=r"unexpected 1: model\.language_model\.layers\.0\.gen_mlp\.up_proj\.weight"):
        load_ar(root)


def test_missing_tensor_fails_naming_it(tmp_path, tiny_root):
    root = _copy_root(tiny_root, tmp_path / "missing")
    _rewrite_weights(root, lambda t: t.pop("llm_model.model.language_model.layers.1.self_attn.v_proj.bias"))
    with pytest.raises(CheckpointMismatch, match=r"missing 1: model\.language_model\.layers\.1\.self_attn\.v_proj\.bias"):
        load_ar(root)


def test_config_weight_disagreement_fails(tmp_path, tiny_root):
    root = _copy_root(tiny_root, tmp_path / "moe")
    config = json.loads((root / "config.json").read_text())
    config["llm_config"]["text_config"]["moe_type"] = "ffn_attention-1:2"  # expects gen q/k/v/o the file lacks
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatch, match="gen_q_proj"):
        load_ar(root)


def test_wrong_shape_fails(tmp_path, tiny_root):
    root = _copy_root(tiny_root, tmp_path / "shape")
    _rewrite_weights(root, lambda t: t.update({"llm_model.gen_head.weight": torch.zeros(70, 64)}))
    with pytest.raises(CheckpointMismatch, match="gen_head.weight"):
        load_ar(root)


def test_vision_tower_keys_are_skipped_not_loaded(tiny_root, tiny_ar):
    visual = open_checkpoint(tiny_root).tensor_names("llm_model.model.visual.")
    assert visual and not any(k.startswith("model.visual") for k in tiny_ar.model.state_dict())


def test_missing_files_are_clear_errors(tmp_path, tiny_root):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_ar(tmp_path / "nowhere")
    root = tmp_path / "noweights"
    root.mkdir()
    shutil.copy(tiny_root / "config.json", root / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_ar(root)


# -- moe_type grammar and expert routing --------------------------------------------------------

def test_moe_grammar_follows_upstream_moe_enable():
    spec = parse_moe_type("ffn-14:28")
    assert spec.layers(28, "ffn") == list(range(14, 28)) and spec.layers(28, "attention") == []
    assert parse_moe_type("ffn_attention").layers(3, "attention") == [0, 1, 2]
    assert parse_moe_type("attention-0:1").layers(4, "attention") == [0]
    assert parse_moe_type("none").layers(4, "ffn") == []
    assert parse_moe_type("ffn-2:99").layers(4, "ffn") == [2, 3]  # an end past the last layer covers the rest


@pytest.mark.parametrize("bad", ["", "mlp", "ffn-3:1", "ffn-1", "ffn-1:1", "FFN", "ffn:1:2", None])
def test_bad_moe_type_rejected(bad):
    with pytest.raises(ValueError):
        parse_moe_type(bad)


def _config(**text_changes):
    llm = tiny_llm_config()
    llm["text_config"].update(text_changes)
    return ar_config_from_dict({"model_type": "mammothmoda2", "llm_config": llm})


def test_moe_range_places_experts():
    model = build_random_ar(_config(num_hidden_layers=4, moe_type="ffn_attention-1:3"), "cpu", torch.float32)
    names = set(model.state_dict())
    lm = "model.language_model.layers"
    assert [f"{lm}.{i}.gen_mlp.gate_proj.weight" in names for i in range(4)] == [False, True, True, False]
    assert [f"{lm}.{i}.self_attn.gen_q_proj.bias" in names for i in range(4)] == [False, True, True, False]
    assert [f"{lm}.{i}.self_attn.gen_o_proj.weight" in names for i in range(4)] == [False, True, True, False]


def test_expert_routing_is_by_token_id(tiny_ar):
    model = tiny_ar.model
    ids = torch.tensor([[10, 20, 30, 520, 530, 512]])  # text, then gen ids
    with torch.no_grad():
        _, before = model(ids)
        copy = build_random_ar(model.config, "cpu", torch.float32)
        copy.load_state_dict(model.state_dict())
        copy.model.language_model.layers[1].gen_mlp.down_proj.weight.add_(0.5)
        _, after = copy(ids)
        # Mixed batches route per position exactly as running each group alone would.
        _, text_only = model(ids[:, :3])
    torch.testing.assert_close(before[0, :3], after[0, :3])  # text positions never touch gen_mlp (and attention is causal)
    assert not torch.allclose(before[0, 3:], after[0, 3:])
    torch.testing.assert_close(text_only, before[:, :3])


def test_gen_ids_use_the_gen_embedding(tiny_ar):
    lm = tiny_ar.model.model.language_model
    with torch.no_grad():
        copy = build_random_ar(tiny_ar.config, "cpu", torch.float32)
        copy.load_state_dict(tiny_ar.model.state_dict())
        copy.model.language_model.gen_embed_tokens.weight[520 - 512].add_(1.0)
        a, b = tiny_ar.model(torch.tensor([[5, 520]]))[1], copy(torch.tensor([[5, 520]]))[1]
    torch.testing.assert_close(a[0, 0], b[0, 0])
    assert not torch.allclose(a[0, 1], b[0, 1])
    assert lm.embed_tokens.num_embeddings == 512 and lm.gen_embed_tokens.num_embeddings == 72


def test_kv_cache_matches_full_forward(tiny_ar):
    ids = torch.tensor([[1, 2, 3, 4, 520, 521, 512, 530]])
    with torch.no_grad():
        _, full = tiny_ar.model(ids)
        cache = KVCache()
        parts = [tiny_ar.model(ids[:, :4], cache=cache)[1], tiny_ar.model(ids[:, 4:6], cache=cache)[1]]
        parts += [tiny_ar.model(ids[:, i : i + 1], cache=cache)[1] for i in range(6, 8)]
    torch.testing.assert_close(torch.cat(parts, 1), full)


# -- conditions: multi-layer aggregation, vocabulary mask -----------------------------------------

def test_condition_layers_average_the_hf_hidden_states(tiny_ar):
    """Entries index the HF output_hidden_states tuple: 0 = embeddings, i = input of layer i, N = final norm."""
    ids = torch.tensor([[5, 9, 520, 530]])
    lm = tiny_ar.model.model.language_model
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone())) for layer in lm.layers]
    with torch.no_grad():
        logits, final = tiny_ar.model(ids)
    for h in hooks:
        h.remove()
    states = [*seen, final]  # len N + 1 = 3
    model = tiny_ar.model
    for layers in ([-1], [0, -1], [-2, -3], [1]):
        aggregated = build_random_ar(dataclasses.replace(model.config, condition_layers=tuple(layers)), "cpu", torch.float32)
        aggregated.load_state_dict(model.state_dict())
        with torch.no_grad():
            got_logits, got = aggregated(ids)
        torch.testing.assert_close(got, torch.stack([states[i] for i in layers]).mean(0))
        torch.testing.assert_close(got_logits, logits)  # logits always come from the final norm
    with pytest.raises(ValueError, match="outside"):
        dataclasses.replace(model.config, condition_layers=(-4,))


def test_condition_layers_come_from_the_root_config():
    llm = preview_llm_config()
    assert ar_config_from_dict({"llm_config": llm}).condition_layers is None
    dev = ar_config_from_dict({"llm_config": llm, "gen_condition_layers": [-2, -5, -8, -11, -14, -17]})
    assert dev.condition_layers == (-2, -5, -8, -11, -14, -17)


def test_non_t2i_requests_mask_the_generation_vocabulary(tiny_ar):
    ids = torch.tensor([[5, 9, 11]])
    with torch.no_grad():
        t2i, _ = tiny_ar.model(ids)
        chat, _ = tiny_ar.model(ids, t2i=False)
    assert torch.isinf(chat[..., 512:]).all() and (chat[..., 512:] < 0).all()
    assert torch.equal(chat[..., :512], t2i[..., :512]) and torch.isfinite(t2i).all()
    logits = torch.zeros(2, 10)
    assert torch.equal(mask_generation_vocab(logits.clone(), 7, t2i=True), logits)
    masked = mask_generation_vocab(logits.clone(), 7, t2i=False)
    assert torch.isinf(masked[:, 7:]).all() and torch.equal(masked[:, :7], logits[:, :7])


# -- t2i_generation_config.json -------------------------------------------------------------------

def test_t2i_config_end_is_exclusive():
    t2i = T2IGenerationConfig.from_dict({"eol_token_id": 152064, "visual_token_start_id": 152072, "visual_token_end_id": 168456,
                                         "do_sample": True, "temperature": 1.0, "top_k": 2048, "top_p": 1.0})
    assert t2i.num_visual_tokens == 16384 == 2**14 and t2i.visual_range == (152072, 168455)
    assert t2i == PREVIEW_T2I


def test_t2i_config_defaults_are_generation_config_defaults():
    t2i = T2IGenerationConfig.from_dict({"eol_token_id": 10, "visual_token_start_id": 12, "visual_token_end_id": 20,
                                         "transformers_version": "4.56.0"})
    assert (t2i.do_sample, t2i.top_k, t2i.top_p, t2i.temperature) == (False, 50, 1.0, 1.0)
    assert t2i.default_temperature == 0.0  # do_sample false: upstream takes the argmax
    with pytest.raises(ValueError, match="lacks"):
        T2IGenerationConfig.from_dict({"eol_token_id": 10, "visual_token_start_id": 12})
    with pytest.raises(ValueError, match="outside"):
        T2IGenerationConfig(eol_token_id=15, visual_token_start_id=12, visual_token_end_id=20)


def test_t2i_file_round_trip(tiny_root, tiny_ar):
    data = json.loads((tiny_root / "t2i_generation_config.json").read_text())
    assert data["visual_token_end_id"] - data["visual_token_start_id"] == 64 and data["do_sample"] is True
    assert T2IGenerationConfig.from_dict(data) == tiny_ar.t2i


# -- Preview shapes ---------------------------------------------------------------------------------

def test_preview_config_numbers():
    config = ar_config_from_dict({"model_type": "mammothmoda2", "llm_config": preview_llm_config()})
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (3584, 28, 28, 4)
    assert (config.intermediate_size, config.vocab_size, config.gen_vocab_start_index) == (18944, 152064, 152064)
    assert config.total_vocab_size == 184864 and config.moe.layers(28, "ffn") == list(range(14, 28))
    assert config.vision_placeholder_ids == (151655, 151656, 151652, 151653)
    counts = count_parameters(config)
    assert 7.5e9 < counts["dense"] < 7.7e9  # Qwen2.5-7B text: 7.62B
    assert 2.8e9 < counts["experts"] < 2.9e9  # 14 SwiGLU FFN copies
    assert counts["gen_vocab"] == 2 * 32800 * 3584
    assert 10.6e9 < counts["total"] < 10.8e9  # ~21.4 GB in bf16


def test_count_parameters_matches_the_module():
    config = _config(num_hidden_layers=3, moe_type="ffn_attention-1:3")
    model = build_ar(config)
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())


def test_random_weights_mode_loads_a_preview_shaped_root_without_weights(tmp_path):
    root = write_ar_only_root(tmp_path / "preview", preview=True)
    assert not list(root.glob("*.safetensors"))
    config = json.loads((root / "config.json").read_text())
    text = config["llm_config"]["text_config"]
    # Scaled down through the same code path (vocabulary and token ids stay Preview's).
    text.update(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                moe_type="ffn-2:4", rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    (root / "config.json").write_text(json.dumps(config))
    loaded = load_ar(root, random_weights=True)
    tok, t2i = loaded.tokenizer, loaded.t2i
    assert len(tok) == 184864 and t2i == PREVIEW_T2I
    ids = tok.convert_tokens_to_ids
    assert [ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")] == [151652, 151653, 151655, 151656]
    assert [ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [151643, 151644, 151645]
    assert (ids("<|endofline|>"), ids("<|image end|>"), ids("<|visual token 0|>")) == (152064, 152071, 152072)
    assert loaded.config.moe.layers(4, "ffn") == [2, 3]
    with torch.no_grad():
        logits, hidden = loaded.model(torch.tensor([[151644, 100, 152069, 152072, 152064]]))
    assert logits.shape == (1, 5, 184864) and hidden.shape == (1, 5, 32) and torch.isfinite(logits).all()
    again = build_random_ar(loaded.config, "cpu", torch.float32, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), loaded.model.state_dict().values(), strict=True))


def test_random_build_never_materialises_on_another_device():
    config = _config()
    model = build_random_ar(config, "cpu", torch.bfloat16)
    assert {p.device.type for p in model.parameters()} == {"cpu"} and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert isinstance(model, MammothModa2AR) and torch.isfinite(model(torch.tensor([[1, 520]]))[0]).all()
