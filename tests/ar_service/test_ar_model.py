import hashlib
import json

import pytest
import torch

from ar_service.model.configuration import MammothARConfig, parse_moe_type
from ar_service.model.loading import load_ar
from ar_service.model.modeling import KVCache, MammothARModel
from ar_service.model.tiny import write_tiny_ar


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_write_tiny_twice_is_byte_identical(tmp_path, tiny_ar_dir):
    write_tiny_ar(tmp_path / "again")
    first, second = _digest(tiny_ar_dir), _digest(tmp_path / "again")
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json", "t2i_generation_config.json"} <= set(first)
    assert sum(p.stat().st_size for p in tiny_ar_dir.iterdir()) < 5_000_000


def test_tokenizer_special_ids(tiny_ar):
    tok, cfg, t2i = tiny_ar.tokenizer, tiny_ar.config, tiny_ar.t2i
    start = cfg.gen_vocab_start_index
    assert (cfg.vocab_size, cfg.gen_vocab_size, start, len(tok)) == (512, 72, 512, 584)
    ids = tok.convert_tokens_to_ids
    assert [ids(t) for t in ("<|endofline|>", "<|image start|>", "<|image end|>", "<|image token|>")] == [
        start, start + 1, start + 2, start + 3
    ]
    assert (ids("<|visual token 0|>"), ids("<|visual token 63|>")) == (start + 8, start + 71)
    assert (t2i.eol_token_id, t2i.visual_token_start_id, t2i.visual_token_end_id) == (start, start + 8, start + 71)
    text_specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>", "<|video_pad|>"]
    assert all(0 <= ids(t) < start for t in text_specials)
    assert (cfg.image_token_id, cfg.video_token_id) == (ids("<|image_pad|>"), ids("<|video_pad|>"))
    encoded = tok("<|image start|>16*16<|image token|>", add_special_tokens=False)["input_ids"]
    digits = tok.convert_tokens_to_ids(["1", "6", "*", "1", "6"])
    assert encoded == [start + 1, *digits, start + 3]
    assert all(d < start for d in digits)


def test_any_text_round_trips(tiny_ar):
    text = "Ünïcode 🦊 prompt\twith <tags> & 1234"
    ids = tiny_ar.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert all(i < 512 for i in ids) and tiny_ar.tokenizer.decode(ids) == text


def test_round_trip_gives_identical_logits(tmp_path):
    cfg = MammothARConfig(moe_type="ffn_attention-1:2", image_token_id=1, video_token_id=2)
    torch.manual_seed(3)
    model = MammothARModel(cfg).eval()
    model.save_pretrained(str(tmp_path))
    loaded, info = MammothARModel.from_pretrained(str(tmp_path), local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[5, 9, 512, 530, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids)[0], loaded.eval()(ids)[0])
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "ardit_mammothmoda2_ar"


def test_load_ar_round_trip(tiny_ar, tiny_ar_dir):
    torch.manual_seed(0)
    fresh = MammothARModel(tiny_ar.config).eval()
    ids = torch.tensor([[3, 100, 512, 525, 600]])
    with torch.no_grad():
        assert torch.equal(fresh(ids)[0], tiny_ar.model(ids)[0])
    logits, hidden = tiny_ar.model(ids)
    assert logits.shape == (1, 5, 584) and logits.dtype == torch.float32 and hidden.shape == (1, 5, 64)


def test_load_ar_errors(tmp_path, tiny_ar_dir):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_ar(tmp_path / "nowhere")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((tiny_ar_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="partial"):
        load_ar(tmp_path / "partial")


def test_load_ar_rejects_mismatched_weights(tmp_path, tiny_ar_dir):
    target = tmp_path / "ar"
    target.mkdir()
    for f in tiny_ar_dir.iterdir():
        target.joinpath(f.name).write_bytes(f.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["moe_type"] = "ffn_attention"  # expects gen q/k/v/o weights the file lacks
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gen_q_proj"):
        load_ar(target)


@pytest.mark.parametrize("bad", ["", "mlp", "ffn-3:1", "ffn-1", "none-0:1", "FFN"])
def test_bad_moe_type_rejected(bad):
    with pytest.raises(ValueError):
        parse_moe_type(bad)


def test_moe_range_places_experts():
    cfg = MammothARConfig(num_hidden_layers=4, moe_type="ffn_attention-1:3")
    names = {n for n, _ in MammothARModel(cfg).named_parameters()}
    assert [f"model.layers.{i}.gen_mlp.gate_proj.weight" in names for i in range(4)] == [False, True, True, False]
    assert [f"model.layers.{i}.self_attn.gen_q_proj.weight" in names for i in range(4)] == [False, True, True, False]
    with pytest.raises(ValueError):
        MammothARConfig(num_hidden_layers=2, moe_type="ffn-0:3")


def test_expert_routing_matters(tiny_ar):
    model = tiny_ar.model
    ids = torch.tensor([[10, 20, 30, 520, 530, 512]])  # text, then gen ids
    with torch.no_grad():
        _, before = model(ids)
        copy = MammothARModel(model.config).eval()
        copy.load_state_dict(model.state_dict())
        for layer in copy.model.layers:
            layer.gen_mlp.down_proj.weight.add_(0.5)
        _, after = copy(ids)
    assert torch.equal(before[0, :3], after[0, :3])  # text-only prefix untouched (causal)
    assert not torch.allclose(before[0, 3:], after[0, 3:])


def test_kv_cache_matches_full_forward(tiny_ar):
    ids = torch.tensor([[1, 2, 3, 4, 520, 521, 512, 530]])
    with torch.no_grad():
        _, full = tiny_ar.model(ids)
        cache = KVCache()
        parts = [tiny_ar.model(ids[:, :4], cache=cache)[1], tiny_ar.model(ids[:, 4:6], cache=cache)[1]]
        parts += [tiny_ar.model(ids[:, i : i + 1], cache=cache)[1] for i in range(6, 8)]
    torch.testing.assert_close(torch.cat(parts, 1), full)
