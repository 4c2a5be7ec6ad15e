"""Which released mammothmoda2 member a directory is, read from config.json, and the member's serving defaults."""

from __future__ import annotations

import json

import pytest

from servicekit.checkpoint import SERVING_FILE, member_of, open_checkpoint

PREVIEW = {"model_type": "mammothmoda2", "llm_config": {"model_type": "mammothmoda2_qwen2_5_vl"},
           "gen_dit_config": {"patch_size": 2}}
DEV = {"model_type": "mammothmoda2", "llm_config": {"model_type": "mammothmoda2_qwen3_vl"},
       "gen_dit_config": {"patch_size": 2, "is_image_embedder": True}}


def _root(tmp_path, config: dict, serving: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if serving is not None:
        (tmp_path / SERVING_FILE).write_text(json.dumps(serving))
    return tmp_path


def test_each_released_layout_is_its_member() -> None:
    assert member_of(PREVIEW) == "preview"
    assert member_of(DEV) == "dev"


@pytest.mark.parametrize(("llm_type", "embedder"), [
    ("mammothmoda2_qwen3_vl", False),  # Dev's AR beside Preview's DiT
    ("mammothmoda2_qwen2_5_vl", True),  # Preview's AR beside Dev's DiT
    ("qwen2_vl", False),  # no member's AR
])
def test_a_layout_of_no_member_is_refused_naming_the_fields(tmp_path, llm_type: str, embedder: bool) -> None:
    config = {"model_type": "mammothmoda2", "llm_config": {"model_type": llm_type},
              "gen_dit_config": {"is_image_embedder": embedder}}
    with pytest.raises(ValueError) as error:
        open_checkpoint(_root(tmp_path, config), require_weights=False)
    message = str(error.value)
    assert f"llm_config.model_type '{llm_type}'" in message
    assert f"gen_dit_config.is_image_embedder {str(embedder).lower()}" in message
    assert "mammothmoda2_qwen3_vl" in message and "mammothmoda2_qwen2_5_vl" in message  # what is known


def test_dev_serves_its_released_grid_and_split_unless_the_file_says_otherwise(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    dev = open_checkpoint(_root(tmp_path / "a", DEV), require_weights=False)
    assert dev.member == "dev"
    assert (dev.serving.grid_rule, dev.serving.grid_tokens, dev.serving.condition_scope) == (
        "token_budget", 256, "prompt_tail")  # 16x16: generate_t2i's ar_height = ar_width = 16
    (tmp_path / "b").mkdir()
    chosen = open_checkpoint(_root(tmp_path / "b", DEV, {"grid_tokens": 1024}), require_weights=False)
    assert (chosen.serving.grid_tokens, chosen.serving.condition_scope) == (1024, "prompt_tail")
    (tmp_path / "c").mkdir()
    preview = open_checkpoint(_root(tmp_path / "c", PREVIEW), require_weights=False)
    assert (preview.member, preview.serving.grid_tokens, preview.serving.condition_scope) == (
        "preview", 1024, "all_generated")
