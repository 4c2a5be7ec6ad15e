"""A tiny but real byte-level BPE tokenizer, trained offline and deterministically on an in-repo corpus.

Layout follows MammothModa2 (Qwen2 text vocab, then the generation vocab; REFERENCE.md / bytedance
mammothmoda t2i_generation_config.json): gen start+0 is the end-of-line token, start+1..3 the image
header tokens, slots up to start+7 reserved, visual tokens from start+8.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEXT_VOCAB_SIZE = 512
NUM_VISUAL_TOKENS = 64
GEN_RESERVED_SLOTS = 8  # EOL + 3 image header tokens + 4 reserved, as in MammothModa2
GEN_VOCAB_SIZE = GEN_RESERVED_SLOTS + NUM_VISUAL_TOKENS

# Text specials sit at the end of the text vocabulary, in Qwen2's relative order.
TEXT_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
EOL_TOKEN = "<|endofline|>"
IMAGE_START_TOKEN = "<|image start|>"
IMAGE_END_TOKEN = "<|image end|>"
IMAGE_TOKEN = "<|image token|>"


def visual_token(index: int) -> str:
    return f"<|visual token {index}|>"


def gen_special_tokens(num_visual: int = NUM_VISUAL_TOKENS) -> list[str]:
    """Generation vocabulary in id order, starting at the gen start index."""
    head = [EOL_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN, IMAGE_TOKEN]
    reserved = [f"<|gen reserved {i}|>" for i in range(len(head), GEN_RESERVED_SLOTS)]
    return head + reserved + [visual_token(i) for i in range(num_visual)]


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


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the BPE (pure function of the corpus), pad the text vocab to TEXT_VOCAB_SIZE, add specials."""
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
    tok.add_special_tokens(fillers + list(TEXT_SPECIAL_TOKENS))
    if tok.get_vocab_size() != TEXT_VOCAB_SIZE:
        raise RuntimeError(f"text vocab came out at {tok.get_vocab_size()}, expected {TEXT_VOCAB_SIZE}")
    tok.add_special_tokens(gen_special_tokens())
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )


def write_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(directory))
    return tokenizer
