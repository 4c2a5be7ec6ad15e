"""The tokenizer of the Preview-shaped directory (``python -m tools.make_tiny --preview``) reads text as Qwen2's does,
and transformers loads it without its Mistral-regex warning."""

from __future__ import annotations

import json
import logging

import pytest
from packaging import version
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from ar_service.model.loading import load_tokenizer
from tools.make_tiny import make_preview_skeleton

# Where Qwen2's split and GPT-2's byte-level regex (with or without single digits) part ways: a contraction in capitals,
# a letter run after a symbol, a punctuation run before newlines, digit runs, runs of spaces, a non-NFC accent.
SAMPLES = [
    "A photo of a red apple",
    "IT'S a #hashtag x_y (sleeping) on 1024x1024 pixels.\n\n  next line",
    "don't\tstop...\r\nnow   ",
    "Cafe\u0301 #42, 3.14159 -- 'quoted'",
]


@pytest.fixture(scope="module")
def preview_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("preview") / "skeleton"
    make_preview_skeleton(root)
    return root


@pytest.fixture(scope="module")
def qwen2_parts():
    """Qwen2's text pipeline as transformers builds it (no vocabulary needed for that)."""
    return json.loads(Qwen2Tokenizer().backend_tokenizer.to_str())


@pytest.mark.parametrize("part", ["normalizer", "pre_tokenizer", "decoder"])
def test_written_tokenizer_json_has_qwen2s_text_pipeline(preview_root, qwen2_parts, part):
    written = json.loads((preview_root / "tokenizer.json").read_text())
    assert written[part] == qwen2_parts[part]


def test_loaded_preview_tokenizer_splits_and_round_trips_text_as_qwen2(preview_root):
    tok = load_tokenizer(preview_root).backend_tokenizer
    qwen2 = Qwen2Tokenizer().backend_tokenizer
    for text in SAMPLES:
        normalized = qwen2.normalizer.normalize_str(text)
        assert tok.normalizer.normalize_str(text) == normalized
        assert tok.pre_tokenizer.pre_tokenize_str(normalized) == qwen2.pre_tokenizer.pre_tokenize_str(normalized)
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == normalized


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_preview_tokenizer_loads_without_the_mistral_regex_warning(preview_root):
    # transformers 5.x skips its Mistral check for a directory whose config.json names a 5.x release; without the
    # field, 5.17 warns for any tokenizer of over 100,000 ids (the installed release may not, hence the first check).
    config = json.loads((preview_root / "config.json").read_text())
    assert version.parse(config["transformers_version"]) >= version.parse("5.0.0")
    records = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        tok = load_tokenizer(preview_root)
    finally:
        logger.removeHandler(records)
    assert len(tok) > 100_000  # large enough for transformers to run the check at all
    assert not [m for m in records.messages if "regex" in m], records.messages
    assert not getattr(tok.backend_tokenizer, "fix_mistral_regex", False)
