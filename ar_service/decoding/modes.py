"""How a decode stream fills its grid: one token per forward, or several.

A decoding mode chooses, before each forward, which tokens a stream feeds (its *lanes*: token, RoPE position, cache
index, and the raster index of the token each lane draws), and, after it, which of the hidden states and drawn tokens
are final. The stream (``decoding.stream.DecodeStream``) commits final ones in raster order, so rows still reach the DiT
in order and the grid contract is checked as before; the scheduler only sees that a stream advanced.

- ``sequential``: one lane, the last token drawn. Today's decode.
- ``speculative`` (lossless): Jacobi decoding with coupled noise. Lane 0 feeds the last token drawn; lanes 1.. feed
  drafts of the tokens after it. Every draw uses the noise of its own (seed, raster index), as the sequential draw
  does (``sampling.gumbel_noise``), so a lane whose whole prefix is right draws exactly the token sequential decoding
  would draw there: the tokens are accepted up to the first draft that differs from the token drawn before it, plus
  that drawn token. The grid is the sequential grid for the same seed (same sampled distribution, any temperature,
  top-k, top-p, AR guidance), and each forward still decides at least one token. Drafts: the tokens the previous
  forward drew past its accepted prefix (Jacobi iteration), else the token above (a grid is spatially coherent),
  else the one to the left; end-of-line columns are forced and always right.
- ``row_parallel`` (lossy, after ZipAR, arXiv 2412.04062): row r+1 starts once row r has ``window`` tokens; every
  started row draws its next token in the same forward. A token sees its row to the left and the rows above as far
  as they have got (attention runs over the cache in generation order; RoPE stays at the raster position), not all of
  the rows above as in sequential decoding: that is the quality cost. Row r's end-of-line token is fed when row r+1
  starts (its hidden state sees row r up to there). Forwards per image: ``(H - 1) * min(window, W) + W``
  (``RowParallel.forwards``) against sequential decoding's ``H * (W + 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ar_service.prompt import Grid
from ar_service.sampling import Draw

SEQUENTIAL, SPECULATIVE, ROW_PARALLEL = "sequential", "speculative", "row_parallel"
MODES = (SEQUENTIAL, SPECULATIVE, ROW_PARALLEL)
#: Lanes a speculative stream feeds per forward unless the request says otherwise.
DEFAULT_SPEC_WINDOW = 8
#: Tokens a row runs ahead of the next in row-parallel decoding unless the request says otherwise.
DEFAULT_ROW_WINDOW = 4


class DecodeStream(Protocol):
    """What a decoding mode reads and fills of its stream (``decoding.stream.DecodeStream``)."""

    tokens: list[int]  # committed, in raster order
    prompt_len: int
    row_len: int  # grid width + its end of line
    grid: Grid
    ready_hidden: dict[int, torch.Tensor]  # raster index -> final hidden state, not yet committed
    ready_tokens: dict[int, int]  # raster index -> final token, not yet committed

    def feeds(self, index: int) -> bool: ...

    def draw_at(self, step: int) -> Draw: ...


class Lane(NamedTuple):
    """One token a stream feeds in a forward: written at ``cache_index`` of its cache, rotated at ``position``; the lane
    draws the token at raster index ``step``."""

    token: int
    position: int
    cache_index: int
    step: int


class Forwarded(NamedTuple):
    """A stream's share of one decode forward: the lanes it fed, their hidden states [len(lanes), H] and the token
    each lane drew (for raster index ``lane.step``)."""

    lanes: list[Lane]
    hidden: torch.Tensor
    tokens: list[int]


@dataclass(frozen=True)
class Decoding:
    """A request's decoding mode, chosen by its plan. ``window``: lanes per forward (speculative) or the lead of a row
    over the next (row_parallel); 1 for sequential."""

    mode: str = SEQUENTIAL
    window: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"decoding mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.window < 1:
            raise ValueError(f"decoding window must be >= 1; got {self.window}")

    def start(self, stream: DecodeStream) -> DecodingState:
        if self.mode == ROW_PARALLEL:
            return RowParallel(stream, self.window)
        return Speculative(stream, self.window if self.mode == SPECULATIVE else 1)


class DecodingState:
    """A stream's decoding mode while it decodes: ``lanes()`` before a forward, ``take()`` after it."""

    #: Whether a forward may leave the stream's raster frontier where it was (no token committed).
    may_stall = False

    def lanes(self) -> list[Lane]:
        raise NotImplementedError

    def take(self, lanes: list[Lane], hidden: torch.Tensor, tokens: list[int]) -> None:
        """Records the forward's final hidden states and drawn tokens in the stream's ``ready_hidden`` /
        ``ready_tokens`` (by raster index)."""
        raise NotImplementedError


def _forced(stream: DecodeStream, index: int) -> int | None:
    """The only id allowed at raster ``index`` (end-of-line columns, the answer window's ``<|image end|>``), if any."""
    (lo, hi), *_ = stream.draw_at(index)
    return lo if lo == hi else None


class Speculative(DecodingState):
    """Sequential decoding at ``window`` 1; Jacobi decoding with coupled noise above (see the module)."""

    def __init__(self, stream: DecodeStream, window: int) -> None:
        self.stream, self.window = stream, window
        self.guesses: dict[int, int] = {}  # raster index -> what the last forward drew there past its accepted prefix

    def lanes(self) -> list[Lane]:
        s = self.stream
        last = len(s.tokens) - 1
        base = s.prompt_len
        lanes = [Lane(s.tokens[last], base + last, base + last, last + 1)]
        known = {last: s.tokens[last]}
        for j in range(1, self.window):
            index = last + j
            if not s.feeds(index):
                break
            token = self._draft(index, known)
            known[index] = token
            lanes.append(Lane(token, base + index, base + index, index + 1))
        return lanes

    def _draft(self, index: int, known: dict[int, int]) -> int:
        s = self.stream
        forced = _forced(s, index)
        if forced is not None:
            return forced
        (lo, hi), *_ = s.draw_at(index)
        above = index - s.row_len

        def token_at(i: int) -> int | None:
            return s.tokens[i] if 0 <= i < len(s.tokens) else known.get(i)

        for guess in (self.guesses.get(index), token_at(above) if above >= 0 else None, token_at(index - 1)):
            if guess is not None and lo <= guess <= hi:
                return guess
        return lo

    def take(self, lanes: list[Lane], hidden: torch.Tensor, tokens: list[int]) -> None:
        s = self.stream
        accepted = 1
        while accepted < len(lanes) and lanes[accepted].token == tokens[accepted - 1]:
            accepted += 1
        for j in range(accepted):
            s.ready_hidden[lanes[j].step - 1] = hidden[j]
            s.ready_tokens[lanes[j].step] = tokens[j]
        self.guesses = {lanes[j].step: tokens[j] for j in range(accepted, len(lanes))}


class RowParallel(DecodingState):
    """Rows decode side by side, each ``window`` tokens behind the one above (see the module)."""

    may_stall = True

    def __init__(self, stream: DecodeStream, window: int) -> None:
        self.stream, self.window = stream, window
        self.width, self.rows = stream.grid.width, stream.grid.height
        self.fed_columns = [0] * self.rows  # visual columns fed, per row (a row feeds left to right)
        self.eol_fed = [False] * self.rows
        self.end_fed = False  # the answer window's <|image end|>
        self.first_open = 0  # rows before it are fed whole
        self.drawn: dict[int, int] = {}  # raster index -> token drawn, until the stream commits it
        self.next_index = stream.prompt_len  # the next cache index: the cache fills in generation order

    @staticmethod
    def forwards(grid: Grid, window: int) -> int:
        """Decode forwards one image takes (the look-ahead token unfed): the last row starts after ``H - 1`` leads of
        ``min(window, W)`` forwards and then needs ``W`` more, its end of line fed with its last visual token."""
        return (grid.height - 1) * min(window, grid.width) + grid.width

    def _token(self, index: int) -> int:
        s = self.stream
        if index < len(s.tokens):
            return s.tokens[index]
        forced = _forced(s, index)
        return forced if forced is not None else self.drawn[index]

    def lanes(self) -> list[Lane]:
        s, row_len, width = self.stream, self.stream.row_len, self.width
        while self.first_open < self.rows and self.eol_fed[self.first_open] and self.fed_columns[self.first_open] == width:
            self.first_open += 1
        feed: list[int] = []
        for r in range(self.first_open, self.rows):
            if r > 0 and not self.eol_fed[r - 1]:
                break  # not started, nor any row below
            fed = self.fed_columns[r]
            if fed < width:
                feed.append(r * row_len + fed)
            if not self.eol_fed[r]:
                last = r == self.rows - 1
                known = min(width, 1 + fed)  # visual tokens of the row drawn so far
                if (last and fed + (fed < width) == width) or (not last and known >= min(self.window, width)):
                    feed.append(r * row_len + width)
        end = s.grid.decode_tokens - 1
        if self.first_open == self.rows and s.feeds(end) and not self.end_fed:
            feed.append(end)
        # Cache indexes in generation order; taken in ``take``, since a decoder may feed only the first lanes.
        return [Lane(self._token(index), s.prompt_len + index, self.next_index + j, index + 1)
                for j, index in enumerate(feed)]

    def take(self, lanes: list[Lane], hidden: torch.Tensor, tokens: list[int]) -> None:
        s, row_len = self.stream, self.stream.row_len
        self.next_index = max(lane.cache_index for lane in lanes) + 1
        for j, lane in enumerate(lanes):
            index = lane.step - 1
            row, column = divmod(index, row_len)
            if index == s.grid.decode_tokens - 1:
                self.end_fed = True
            elif column == self.width:
                self.eol_fed[row] = True
            else:
                self.fed_columns[row] += 1
            s.ready_hidden[index] = hidden[j]
            s.ready_tokens[lane.step] = tokens[j]
            if lane.step >= len(s.tokens):
                self.drawn[lane.step] = tokens[j]
        for index in [i for i in self.drawn if i < len(s.tokens)]:
            del self.drawn[index]
