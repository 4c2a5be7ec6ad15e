"""The edit world: what each edit changes, how edits split, how instructions read, and how the evaluator scores an
answer against the edit's target."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import asdict

from train.detect import Detection, detect
from train.edits import (
    EDIT_KINDS,
    KIND_ATTRIBUTE,
    TO_WORDS,
    Edit,
    all_edits,
    edit_examples,
    edit_scores,
    held_out_edit_examples,
    instruction,
    split_edits,
)
from train.evaluate import edit_table
from train.shapes import COLOURS, POSITION_WORDS, POSITIONS, SHAPE_WORDS, Scene, render, split_scenes


def differing(a: Scene, b: Scene) -> set[str]:
    return {field for field, value in asdict(a).items() if asdict(b)[field] != value}


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text))


def test_every_edit_changes_exactly_its_kinds_attribute_into_a_valid_scene():
    edits = all_edits()
    assert all(differing(e.source, e.target) == {KIND_ATTRIBUTE[e.kind]} for e in edits)
    assert all(e.target.colour != e.target.background for e in edits)
    # 2,240 scenes, each with 6 other shape colours, 4 other positions, 3 other outlines, 6 other backgrounds
    assert len(edits) == 2240 * (6 + 4 + 3 + 6) == len(set(edits))


def test_held_out_edits_never_have_a_training_scene_in_any_role_and_every_kind_is_in_both_splits():
    training_scenes, held_scenes = split_scenes()
    training, held = split_edits()
    train_set, held_set = set(training_scenes), set(held_scenes)
    assert all(e.source in train_set and e.target in train_set for e in training)
    assert all(e.source in held_set or e.target in held_set for e in held)
    assert len(training) + len(held) == len(all_edits()) and not set(training) & set(held)
    assert {e.kind for e in training} == {e.kind for e in held} == set(EDIT_KINDS)
    # a held-out scene reaches training neither as an input nor as an output
    assert not {s for e in training for s in (e.source, e.target)} & held_set


def test_instructions_vary_name_the_new_value_and_only_change_words_for_the_edited_attribute():
    rng = random.Random(3)
    edits = random.Random(4).sample(all_edits(), 400)
    wordings = {kind: set() for kind in EDIT_KINDS}
    for edit in edits:
        text = instruction(edit, rng)
        wordings[edit.kind].add(re.sub(r"\b(" + "|".join(COLOURS) + r")\b", "C", text))
        source, target = edit.source, edit.target
        new = {"recolour": [target.colour], "background": [target.background],
               "reshape": SHAPE_WORDS[target.shape],
               "move": [*POSITION_WORDS[target.position], *TO_WORDS[target.position]]}[edit.kind]
        assert any(value in text for value in new), (edit, text)
        assert source.background not in words(text), (edit, text)  # the background is never named unless changed
        if edit.kind != "move":  # no position word, old or new, outside a move
            assert not any(p in text for phrases in POSITION_WORDS.values() for p in phrases if " " in p), text
        if edit.kind == "background":  # the shape is not referred to
            assert not words(text) & {w for ws in SHAPE_WORDS.values() for w in ws}, text
        else:  # the shape is named by its current outline
            assert words(text) & set(SHAPE_WORDS[source.shape]), text
        assert not words(text) & {"small", "little", "large", "big"}, text
    assert all(len(wordings[kind]) >= 4 for kind in EDIT_KINDS), wordings


def test_held_out_edit_examples_are_fixed_for_a_seed_and_balanced_per_kind():
    first, again = held_out_edit_examples(40), held_out_edit_examples(40)
    assert first == again and held_out_edit_examples(40, seed=1) != first
    assert Counter(x.edit.kind for x in first) == {kind: 10 for kind in EDIT_KINDS}
    assert [x.edit.kind for x in first[:4]] == list(EDIT_KINDS)  # round-robin: the first n are balanced too
    _, held = split_edits()
    assert {x.edit for x in first} <= set(held) and len({x.edit for x in first}) == 40
    drawn = edit_examples(held, 8, seed=5)
    assert drawn == edit_examples(held, 8, seed=5) and [x.instruction for x in drawn] != [
        x.instruction for x in edit_examples(held, 8, seed=6)]


def test_edit_scores_say_whether_the_asked_change_happened_and_the_rest_stayed():
    source = Scene("circle", "red", "left", "large", "blue")
    edit = Edit(source, Scene("circle", "green", "left", "large", "blue"), "recolour")

    def found(scene: Scene) -> Detection:
        return Detection(scene.background, scene.shape, scene.colour, scene.position)

    assert edit_scores(found(edit.target), edit) == {"changed": True, "kept": True, "all": True}
    assert edit_scores(found(source), edit) == {"changed": False, "kept": True, "all": False}  # left as it was
    moved_too = Scene("circle", "green", "right", "large", "blue")
    assert edit_scores(found(moved_too), edit) == {"changed": True, "kept": False, "all": False}
    assert edit_scores(Detection("blue", None, None, None), edit) == {"changed": False, "kept": False, "all": False}
    # the detector reads a clean render of the target as a fully right answer, for every kind
    for e in held_out_edit_examples(8):
        assert edit_scores(detect(render(e.edit.target)), e.edit) == {"changed": True, "kept": True, "all": True}
        assert edit_scores(detect(render(e.edit.source)), e.edit) == {"changed": False, "kept": True, "all": False}


def test_the_edit_table_has_a_row_per_kind_and_overall():
    rates = {kind: {"count": 2, "changed": 0.5, "kept": 1.0, "all": 0.5} for kind in EDIT_KINDS}
    rates["overall"] = {"count": 8, "changed": 0.5, "kept": 1.0, "all": 0.5}
    lines = edit_table(rates).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["edit", "changed", "kept", "all"]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert list(rows) == [*EDIT_KINDS, "overall"]
    assert rows["move"] == ["50.0% (1/2)", "100.0% (2/2)", "50.0% (1/2)"] and rows["overall"][1] == "100.0% (8/8)"


def test_position_words_are_the_shapes_worlds():
    assert set(TO_WORDS) == set(POSITIONS)
