"""Tokenizers for the tiny and the Preview-shaped random models, in MammothModa2's id layout.

Layout facts (vllm-omni ``vllm_omni/model_executor/models/mammoth_moda2/tokenization_mammothmoda2_qwen2_5_vl.py``,
the MammothU tokenizer of Preview): Qwen2.5 specials from id 151643 (``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>``, then ``<|object_ref_start|>`` ... with ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653,
``<|image_pad|>`` 151655, ``<|video_pad|>`` 151656), padding up to the text embedding size 152064, then the
generation vocabulary: ``<|endofline|>`` (152064, the EOL), ``<|endoffile|>``, ``<|gen_placeholder|>``,
``<|useless token|>``, ``<|beginoftext|>``, then the vision tokens file, whose first three are the image
header tokens (``<|image end|>`` = 152071: vllm-omni's ``end_of_image_id``; the order of ``<|image start|>``
and ``<|image token|>`` at 152069 / 152070 is inferred), and visual tokens from 152072
(``<|visual token N|>``, the form upstream's ``remap_unified_tokens`` regex reads).

The tiny tokenizer keeps that gen layout (8 header slots, then visual tokens) over a 512-id text vocabulary
trained offline and deterministically on an in-repo corpus. The Preview-shaped tokenizer is a byte-level
vocabulary with no merges, padded with unreachable placeholders up to 151643 so every special id matches
Preview's; it exists to drive the random-weight benchmark model, not to read text well. Its normalizer,
pre-tokenizer and decoder are Qwen2's (``QWEN2_PRETOKENIZE_REGEX``), so text splits as Preview's own tokenizer
splits it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEXT_VOCAB_SIZE = 512
NUM_VISUAL_TOKENS = 64
EOL_TOKEN = "<|endofline|>"
IMAGE_START_TOKEN = "<|image start|>"
IMAGE_TOKEN = "<|image token|>"
IMAGE_END_TOKEN = "<|image end|>"
# Generation-vocabulary header in id order from gen_vocab_start_index (see module docstring).
GEN_HEADER_TOKENS = (
    EOL_TOKEN,
    "<|endoffile|>",
    "<|gen_placeholder|>",
    "<|useless token|>",
    "<|beginoftext|>",
    IMAGE_START_TOKEN,
    IMAGE_TOKEN,
    IMAGE_END_TOKEN,
)
GEN_RESERVED_SLOTS = len(GEN_HEADER_TOKENS)  # visual tokens start at gen start + 8 (152072 in Preview)
GEN_VOCAB_SIZE = GEN_RESERVED_SLOTS + NUM_VISUAL_TOKENS

# Qwen2.5 chat / vision specials, in Qwen's relative order (tiny: at the end of its text vocabulary).
TEXT_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Preview: ids from 151643 (MammothU's SPECIAL_START_ID), Qwen2.5's order.
QWEN_SPECIAL_START_ID = 151643
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)


# Qwen2's pre-tokenizer split (transformers ``models/qwen2/tokenization_qwen2.py`` PRETOKENIZE_REGEX, the pattern of
# the Qwen2 / Qwen2.5 tokenizer.json files): contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def visual_token(index: int) -> str:
    return f"<|visual token {index}|>"


def gen_special_tokens(gen_vocab_size: int = GEN_VOCAB_SIZE) -> list[str]:
    """Generation vocabulary in id order, starting at the gen start index."""
    return list(GEN_HEADER_TOKENS) + [visual_token(i) for i in range(gen_vocab_size - GEN_RESERVED_SLOTS)]


_CORPUS = """
You are a helpful image generator. Draw a photo of a red apple on a wooden table in the morning light.
A painting of a small house by the sea, with blue sky, white clouds and green grass around it.
An astronaut riding a horse on the moon, digital art, highly detailed, 4k, cinematic lighting.
A cat sitting on a windowsill watching the rain; a dog sleeping beside the fireplace at night.
Portrait of an old man with a gray beard, oil painting, warm colors, soft shadows, sharp focus.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048.
A city street at sunset, people walking, cars, tall buildings, reflections in the wet road.
Mountains covered in snow under a starry sky, a lake in the foreground, long exposure photograph.
A bowl of fruit: bananas, oranges, grapes and pears, still life, studio lighting, black background.
Flowers in a glass vase, watercolor style, pastel colors, white paper texture, simple composition.
A robot reading a book in a library, anime style, big eyes, bright colors, clean line art.
Two children playing football in a park, summer afternoon, trees, benches and a small fountain.
A futuristic car parked in front of a modern glass building, product shot, 3d render, reflections.
An underwater scene with colorful fish, coral reef, sun rays through the water, turquoise tones.
A steaming cup of coffee and a croissant on a marble table, top view, food photography, cozy.
"""


def _specials(tokens) -> list[AddedToken]:
    return [AddedToken(t, special=True, normalized=False) for t in tokens]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Tiny: train the BPE (pure function of the corpus), pad the text vocab to 512, add specials and gen vocab."""
    bpe_size = TEXT_VOCAB_SIZE - len(TEXT_SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    # Single digits like Qwen2, so "16*16" becomes digit tokens; byte-level so any text encodes.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line], trainer=trainer)
    fillers = [f"<|text reserved {i}|>" for i in range(bpe_size - tok.get_vocab_size())]
    tok.add_special_tokens(_specials(fillers + list(TEXT_SPECIAL_TOKENS)))
    if tok.get_vocab_size() != TEXT_VOCAB_SIZE:
        raise RuntimeError(f"text vocab came out at {tok.get_vocab_size()}, expected {TEXT_VOCAB_SIZE}")
    tok.add_special_tokens(_specials(gen_special_tokens()))
    return _wrap(tok)


def build_preview_tokenizer(text_vocab_size: int = 152064, gen_vocab_size: int = 32800) -> PreTrainedTokenizerFast:
    """Preview-id-compatible tokenizer built in well under a second: bytes, placeholders, Qwen specials, gen vocab."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(len(vocab), QWEN_SPECIAL_START_ID):
        vocab[f"<|ardit unused {i}|>"] = i  # never produced: there are no merges
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    _use_qwen2_text_pipeline(tok)
    pad = [f"<|extra_{i}|>" for i in range(text_vocab_size - QWEN_SPECIAL_START_ID - len(QWEN_SPECIAL_TOKENS))]
    tok.add_special_tokens(_specials(list(QWEN_SPECIAL_TOKENS) + pad + gen_special_tokens(gen_vocab_size)))
    if tok.get_vocab_size() != text_vocab_size + gen_vocab_size:
        raise RuntimeError(f"preview tokenizer came out at {tok.get_vocab_size()} ids")
    return _wrap(tok)


def _use_qwen2_text_pipeline(tok: Tokenizer) -> None:
    """Qwen2's text path around the model (transformers' Qwen2Tokenizer): NFC, the split regex with each match kept
    as its own piece, byte-level without a prefix space (the split already did GPT-2's job), byte-level decoding."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def write_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(directory))
    return tokenizer
