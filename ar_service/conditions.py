"""Which of the AR's hidden states condition the DiT, and the prompts around them: the T2I and negative prompt ids,
the text condition's mask, the image condition's rows and their count, and the serving settings that choose among the
released behaviours (``DecodeChoices``). No model runs here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ar_service.model.configuration import ARConfig
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.model.tokenizer import IMAGE_END_TOKEN
from ar_service.prompt import Grid, build_negative_prompt, build_t2i_prompt

#: Which generated positions become the DiT's image condition (``ServingDefaults.condition_scope``).
#: ``all_generated``: every grid position (visual tokens and EOLs), the look-ahead token dropped (vllm-omni
#: ``ar2dit``; bytedance/mammothmoda main branch for the Dev model). ``answer_window``: the released Preview code
#: (qwen25vl ``mammothmoda2/utils/t2i_utils.py`` lines 293-305): the sequence prompt + grid + ``<|image end|>``
#: is split at ``len - 10``; generation-vocabulary ids after the split are the image condition (about 10 rows),
#: and only positions before it may be text condition.
#: ``prompt_tail``: the released Dev code (bytedance/mammothmoda main ``mamoda2/mammothmoda2/utils/t2i_utils.py``
#: 310-314 and 111-137): the split lies 10 positions before the prompt's end (``prompt_ids.shape[1] - 10``); every
#: generation-vocabulary id from there on is the image condition: the prompt's ``<|image start|>`` and
#: ``<|image token|>``, the whole grid and ``<|image end|>``; only the question before the split is text condition
#: (all text positions when the checkpoint sets ``gen_text_condition_with_answer``).
ALL_GENERATED = "all_generated"
ANSWER_WINDOW = "answer_window"
PROMPT_TAIL = "prompt_tail"
CONDITION_SCOPES = (ALL_GENERATED, ANSWER_WINDOW, PROMPT_TAIL)
#: The released answer windows: Preview's last 10 positions of prompt + grid + ``<|image end|>``; Dev's split 10
#: positions before the prompt's end.
ANSWER_WINDOW_POSITIONS = 10
#: The scopes that feed ``<|image end|>`` after the grid and take its hidden state into the image condition.
FEEDS_IMAGE_END = (ANSWER_WINDOW, PROMPT_TAIL)


class ConditionLengthError(RuntimeError):
    """The generated positions carrying generation-vocabulary ids are not ``ar_h * (ar_w + 1)``: the DiT would get
    a condition of the wrong shape, so the request fails (the engine answers INTERNAL with this message)."""


@dataclass(frozen=True)
class DecodeChoices:
    """What a checkpoint's serving settings (servicekit ``ServingDefaults``) choose where the released code and
    ardit's defaults differ: the visual range sampled, which rows become the image condition (and the
    ``<|image end|>`` id that ``answer_window`` feeds), the negative prompt used when a request has none."""

    t2i: T2IGenerationConfig
    condition_scope: str = ALL_GENERATED
    image_end_id: int | None = None
    default_negative_prompt: str = ""

    @classmethod
    def from_serving(cls, t2i: T2IGenerationConfig, config: ARConfig, tokenizer, serving) -> DecodeChoices:
        if serving.visual_token_scope == "start_plus_end":
            t2i = t2i.with_released_scope(config.total_vocab_size)
        image_end_id = None
        if serving.condition_scope != ALL_GENERATED:
            image_end_id = tokenizer.convert_tokens_to_ids(IMAGE_END_TOKEN)
            if image_end_id is None or image_end_id < config.gen_vocab_start_index:
                raise ValueError(f"condition_scope {serving.condition_scope} needs {IMAGE_END_TOKEN} in the tokenizer's "
                                 "generation vocabulary")
        return cls(t2i, serving.condition_scope, image_end_id, serving.default_negative_prompt)


def prompt_ids_for(tokenizer, prompt: str, grid: Grid) -> list[int]:
    return list(tokenizer(build_t2i_prompt(prompt, grid), add_special_tokens=False)["input_ids"])


def text_condition_mask(prompt_ids: list[int], config: ARConfig, question_end: int | None = None) -> torch.Tensor:
    """Prompt positions that condition the DiT: no vision placeholders, nothing from the gen vocab, and (when
    ``question_end`` is given, see ``question_end``) nothing from that position on.

    vllm-omni ``stage_input_processors/mammoth_moda2.py`` (``ar2dit``): ``questions_mask & ~(visual_token_mask |
    gen_token_mask)`` with visual ids <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
    (151655/151656/151652/151653 in Preview, read from llm_config) and gen ids ``>= gen_vocab_start_index``.
    """
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    mask = ids < config.gen_vocab_start_index
    for token in config.vision_placeholder_ids:
        mask &= ids != token
    if question_end is not None:
        mask[question_end:] = False
    return mask


def question_end(prompt_len: int, grid: Grid, scope: str, with_answer: bool = False) -> int | None:
    """Where the question (the positions that may be text condition) ends: nowhere inside the prompt for
    ``all_generated``; for ``answer_window`` at ``len(prompt + grid + <|image end|>) - 10``, which cuts into the
    prompt only for grids of fewer than 9 positions; for ``prompt_tail`` 10 positions before the prompt's end, or
    nowhere when ``with_answer`` (the checkpoint's ``gen_text_condition_with_answer``, t2i_utils.py 118-121)."""
    if scope == ALL_GENERATED or (scope == PROMPT_TAIL and with_answer):
        return None
    if scope == PROMPT_TAIL:
        return max(0, prompt_len - ANSWER_WINDOW_POSITIONS)
    return min(prompt_len, prompt_len + grid.condition_positions + 1 - ANSWER_WINDOW_POSITIONS)


def prompt_tail_rows(prompt_ids: list[int], config: ARConfig) -> list[int]:
    """Under ``prompt_tail``: the prompt positions that lead the image condition, i.e. its generation-vocabulary ids
    in the last 10 (``<|image start|>`` and ``<|image token|>`` in the T2I envelope)."""
    start = max(0, len(prompt_ids) - ANSWER_WINDOW_POSITIONS)
    return [i for i in range(start, len(prompt_ids)) if prompt_ids[i] >= config.gen_vocab_start_index]


def grid_condition_offset(prompt_ids: list[int], scope: str, config: ARConfig) -> int:
    """Row of the image condition where the grid's first row goes (rows before it come from the prompt)."""
    return len(prompt_tail_rows(prompt_ids, config)) if scope == PROMPT_TAIL else 0


def image_condition_positions(prompt_ids: list[int], grid: Grid, scope: str, config: ARConfig) -> int:
    """Rows of the image condition an image of ``grid`` hands the DiT under ``scope`` (known before decoding: every
    grid position and ``<|image end|>`` are generation-vocabulary ids)."""
    if scope == ALL_GENERATED:
        return grid.condition_positions
    if scope == PROMPT_TAIL:
        return len(prompt_tail_rows(prompt_ids, config)) + grid.condition_positions + 1
    if scope != ANSWER_WINDOW:
        raise ValueError(f"condition scope must be one of {', '.join(CONDITION_SCOPES)}; got {scope!r}")
    generated = grid.condition_positions + 1  # the grid and <|image end|>
    from_prompt = max(0, ANSWER_WINDOW_POSITIONS - generated)
    prompt_tail = prompt_ids[len(prompt_ids) - from_prompt :] if from_prompt else []
    return min(generated, ANSWER_WINDOW_POSITIONS) + sum(t >= config.gen_vocab_start_index for t in prompt_tail)


def image_condition_mask(generated_ids: list[int], config: ARConfig) -> torch.Tensor:
    """Generated positions that condition the DiT: ids in the generation vocabulary (visual tokens and EOLs),
    the final look-ahead token dropped (it is never fed, so it has no hidden state; vllm-omni ``ar2dit``:
    ``cumulative_token_ids[:-1]``, then ``answers_mask & gen_token_mask``)."""
    ids = torch.tensor(generated_ids[:-1], dtype=torch.long)
    return ids >= config.gen_vocab_start_index


def check_image_condition(generated_ids: list[int], config: ARConfig, grid: Grid) -> None:
    """The image condition must be exactly ``ar_h * (ar_w + 1)`` rows; anything else fails the request."""
    count = int(image_condition_mask(generated_ids, config).sum())
    if count != grid.condition_positions:
        raise ConditionLengthError(
            f"image condition has {count} positions; a {grid.width}x{grid.height} grid needs "
            f"{grid.height} * ({grid.width} + 1) = {grid.condition_positions}"
        )


def negative_prompt_ids(tokenizer, negative_prompt: str) -> list[int]:
    return list(tokenizer(build_negative_prompt(negative_prompt), add_special_tokens=False)["input_ids"])

