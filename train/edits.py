"""The edit world: a source scene, an instruction that changes one attribute, and the scene it should become.

An edit changes exactly one attribute of a shapes scene (``train.shapes``): the shape's colour, its position, its
outline or the background's colour; everything else stays. Instructions come from a small imperative grammar
("make the circle blue", "move the red star to the left", "paint the background yellow") that names the new value
and refers to the shape only by what it is now.

The split follows the scenes' split: an edit is held out when its source OR its target is a held-out scene, and
trains only when both are training scenes. A model that learnt to edit training scenes then never saw a held-out
scene in any role, neither as an input it was shown nor as an output it was taught to draw, so the evaluator's
edits ask it to compose, as the captions' held-out triples do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING

from train.shapes import COLOURS, POSITION_WORDS, POSITIONS, SHAPE_WORDS, SHAPES, Scene, all_scenes, split_scenes

if TYPE_CHECKING:
    from train.detect import Detection

EDIT_KINDS = ("recolour", "move", "reshape", "background")
#: The Scene field each kind changes.
KIND_ATTRIBUTE = {"recolour": "colour", "move": "position", "reshape": "shape", "background": "background"}
_VALUES = {"colour": COLOURS, "position": tuple(POSITIONS), "shape": SHAPES, "background": COLOURS}

# "move the star on the left" would read as "the star that is on the left": moves say where to.
TO_WORDS = {
    "left": ("to the left", "to the left side"),
    "right": ("to the right", "to the right side"),
    "top": ("to the top", "up to the top"),
    "bottom": ("to the bottom", "down to the bottom"),
    "centre": ("to the centre", "to the center", "to the middle"),
}
TEMPLATES = {
    "recolour": ("make the {ref} {new}", "turn the {ref} {new}", "paint the {ref} {new}", "colour the {ref} {new}",
                 "change the colour of the {ref} to {new}"),
    "move": ("move the {ref} {to}", "shift the {ref} {to}", "put the {ref} {pos}", "place the {ref} {pos}"),
    "reshape": ("change the {ref} into a {new}", "turn the {ref} into a {new}", "replace the {ref} with a {new}",
                "make the {ref} a {new}"),
    "background": ("paint the background {new}", "make the background {new}", "change the background to {new}",
                   "turn the backdrop {new}", "give it a {new} background"),
}


@dataclass(frozen=True)
class Edit:
    source: Scene
    target: Scene
    kind: str


@dataclass(frozen=True)
class EditExample:
    edit: Edit
    instruction: str


@cache
def _all_edits() -> tuple[Edit, ...]:
    edits = []
    for source in all_scenes():
        for kind in EDIT_KINDS:
            attribute = KIND_ATTRIBUTE[kind]
            for value in _VALUES[attribute]:
                target = replace(source, **{attribute: value})
                if value != getattr(source, attribute) and target.colour != target.background:
                    edits.append(Edit(source, target, kind))
    return tuple(edits)


def all_edits() -> list[Edit]:
    """Every valid edit of every scene: each other value of each kind's attribute that leaves the shape's colour
    unlike the background's."""
    return list(_all_edits())


def split_edits(seed: int = 0) -> tuple[list[Edit], list[Edit]]:
    """(training edits: both scenes train, held-out edits: either scene is held out)."""
    _, held_scenes = split_scenes(seed)
    held = set(held_scenes)
    edits = _all_edits()
    return ([e for e in edits if e.source not in held and e.target not in held],
            [e for e in edits if e.source in held or e.target in held])


def instruction(edit: Edit, rng: random.Random) -> str:
    """One wording of ``edit``: the new value, and the shape named by its current outline (and maybe colour)."""
    source, target = edit.source, edit.target
    shape = rng.choice(SHAPE_WORDS[source.shape])
    ref = f"{source.colour} {shape}" if rng.random() < 0.5 else shape
    new = {"recolour": target.colour, "reshape": rng.choice(SHAPE_WORDS[target.shape]),
           "background": target.background, "move": ""}[edit.kind]
    return rng.choice(TEMPLATES[edit.kind]).format(ref=ref, new=new, to=rng.choice(TO_WORDS[target.position]),
                                                   pos=rng.choice(POSITION_WORDS[target.position]))


def edit_examples(edits: list[Edit], count: int, seed: int) -> list[EditExample]:
    """``count`` examples taking the kinds in turn (each kind's edits cycled in a seeded order), each with a freshly
    drawn wording."""
    rng = random.Random(seed)
    pools = {kind: [e for e in edits if e.kind == kind] for kind in EDIT_KINDS}
    kinds = [kind for kind in EDIT_KINDS if pools[kind]]
    queues: dict[str, list[Edit]] = {kind: [] for kind in kinds}
    chosen = []
    for i in range(count if kinds else 0):
        kind = kinds[i % len(kinds)]
        if not queues[kind]:
            queues[kind] = list(pools[kind])
            rng.shuffle(queues[kind])
        chosen.append(queues[kind].pop())
    return [EditExample(edit, instruction(edit, rng)) for edit in chosen]


def held_out_edit_examples(count: int, seed: int = 0) -> list[EditExample]:
    """The evaluator's questions: the same ``count`` held-out edits, worded the same, for a seed."""
    _, held = split_edits()
    return edit_examples(held, count, seed=random.Random(seed).randrange(2**31))


def edit_scores(found: Detection, edit: Edit) -> dict[str, bool]:
    """changed: the attribute the edit asks for reads as the target's; kept: every other attribute reads as the
    source's (which the target shares); all: the picture reads as the target."""
    scores = found.scores(edit.target)
    asked = KIND_ATTRIBUTE[edit.kind]
    return {"changed": scores[asked], "kept": all(scores[a] for a in _VALUES if a != asked), "all": scores["all"]}
