"""The Dev shapes model's training code path at micro scale on the CPU: warm start from the Preview shapes checkpoint,
MammothTok, AR and DiT stages, a checkpoint the services load as the Dev member (MammothTok, Q-Former, reference
path), and the stages' inputs equal to what the services build at serving time."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from ar_service.edit_image import pixels_from_image, resize_for_mammothtok
from ar_service.generation import generate_grid
from ar_service.model.loading import load_ar
from ar_service.model.mammothtok import CHECKPOINT_PREFIX
from ar_service.planning import RequestPlanner
from ar_service.sampling import SamplingParams
from dit_service.model.pipeline import DIT_PREFIX, VAE_PREFIX, DiTPipeline
from protos.knobs import FAMILIES
from servicekit.checkpoint import open_checkpoint
from train import dev_architecture, dev_stages, report
from train.dev_all import DEFAULT_WARM_START, parser, run
from train.edits import split_edits
from train.shapes import Scene
from train.stages import StageLog, grid, run_loop, scene_grid_ids


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("dev-train")
    out = root / "model"
    record = run(parser().parse_args(["--out", str(out), "--device", "cpu", "--scale", "micro",
                                      "--target-weight", "square=3", "--target-weight", "small=2",
                                      "--dit-shape-weight", "4", "--dit-captions", "3",
                                      "--qformer-lr-scale", "3"]))
    return out, record


@pytest.fixture(scope="module")
def loaded(trained):
    return load_ar(trained[0])


def test_micro_training_writes_a_dev_checkpoint_the_services_load(trained, loaded) -> None:
    out, record = trained
    assert [s["stage"] for s in record["stages"]] == ["mammothtok", "ar", "dit"]
    assert all(s["steps"] >= 1 and s["losses"] for s in record["stages"])
    assert record["stages"][2]["data"]["edits"] > 0 and record["held_out_edits"][0]["edits"] >= 1
    assert record["stages"][2]["data"]["target_weights"] == {"square": 3.0, "small": 2.0}
    assert record["stages"][2]["data"]["shape_weight"] == 4.0
    assert record["stages"][2]["data"]["captions"] == 3  # --dit-captions over the micro scale's 2
    assert record["stages"][2]["data"]["qformer_lr_scale"] == 3.0
    log = json.loads((out.parent / report.LOG_NAME).read_text())
    assert log["runs"][-1]["warm_start_report"]["tensors_copied"]["dit"] > 90

    checkpoint = open_checkpoint(out)
    assert checkpoint.member == "dev"
    assert checkpoint.serving.condition_scope == "prompt_tail"
    assert checkpoint.serving.knob_defaults["image_guidance_scale"] == record["image_guidance_default"]
    assert loaded.mammothtok is not None and not loaded.edit_refusal
    assert loaded.config.member == "dev" and loaded.config.qk_norm
    pipeline = DiTPipeline.from_checkpoint(checkpoint)
    assert pipeline.transformer.is_image_embedder and pipeline.max_reference_images == 5

    # The VAE is the Preview model's, exactly, with its factors; no stage trains it.
    preview = open_checkpoint(DEFAULT_WARM_START)
    for name, tensor in preview.load_tensors(VAE_PREFIX, "cpu", torch.float32).items():
        torch.testing.assert_close(checkpoint.load_tensors(VAE_PREFIX, "cpu", torch.float32)[name], tensor, rtol=0, atol=0)
    for key in ("scaling_factor", "shift_factor"):
        assert checkpoint.config["gen_vae_config"][key] == preview.config["gen_vae_config"][key]


def test_target_weights_multiply_by_shape_and_size_and_a_bad_one_names_the_accepted(capsys) -> None:
    weights = {"square": 3.0, "small": 2.0}
    assert dev_stages.target_weight(Scene("square", "red", "centre", "small", "white"), weights) == 6.0
    assert dev_stages.target_weight(Scene("circle", "red", "centre", "large", "white"), weights) == 1.0
    for bad in ("hexagon=2", "square", "square=0", "square=x", "square=inf", "square=nan"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--out", "x", "--target-weight", bad])
        err = capsys.readouterr().err
        assert "--target-weight" in err
        if bad == "hexagon=2":
            assert "circle, square, triangle, star, small, large" in err


def test_a_shape_weight_below_zero_or_not_a_number_is_refused(capsys) -> None:
    """1 + W weighs the shape's latents: W below 0 would weigh them down to nothing or below."""
    assert parser().parse_args(["--out", "x", "--dit-shape-weight", "4"]).dit_shape_weight == 4.0
    assert parser().parse_args(["--out", "x"]).dit_shape_weight == 0.0
    for bad in ("-1", "x", "inf", "nan"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--out", "x", "--dit-shape-weight", bad])
        assert "--dit-shape-weight: must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--dit-captions", "--dit-batch"])
def test_a_caption_pool_or_batch_that_is_not_a_positive_count_is_refused(capsys, flag) -> None:
    """0 is refused too, not taken as the scale's default."""
    name = flag[2:].replace("-", "_")
    assert getattr(parser().parse_args(["--out", "x", flag, "16384"]), name) == 16384
    assert getattr(parser().parse_args(["--out", "x"]), name) is None  # the scale's
    for bad in ("0", "-5", "1.5", "many"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--out", "x", flag, bad])
        assert f"{flag}: must be a whole number >= 1" in capsys.readouterr().err


def test_the_qformer_learns_at_its_own_rate_and_every_dit_tensor_once(capsys) -> None:
    dit, _ = dev_architecture.new_dit_and_vae("cpu", 0)
    rest, qformer = dev_stages.qformer_groups(dit, 4.0)
    assert qformer["lr_scale"] == 4.0 and rest["lr_scale"] == 1.0
    assert {id(p) for p in qformer["params"]} == {id(p) for p in dit.time_caption_embed.image_embedder.parameters()}
    assert sorted(id(p) for g in (rest, qformer) for p in g["params"]) == sorted(id(p) for p in dit.parameters())
    # AdamW's first step moves a parameter by about its rate, whatever its gradient: the scaled one 4 times as far.
    slow, fast = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    run_loop(StageLog("probe"), [{"params": [slow]}, {"params": [fast], "lr_scale": 4.0}],
             lambda step: (slow - 1) ** 2 + (fast - 1) ** 2, max_steps=1, budget_s=60, lr=1e-3, warmup=1)
    torch.testing.assert_close(fast.detach(), 4 * slow.detach())
    assert slow.item() == pytest.approx(1e-3, rel=1e-3)
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--out", "x", "--qformer-lr-scale", bad])
        assert "--qformer-lr-scale: must be a positive finite number" in capsys.readouterr().err


def test_warm_start_copies_matching_tensors_and_leaves_the_new_ones_fresh() -> None:
    ar = dev_architecture.new_ar("cpu", 0)
    dit, vae = dev_architecture.new_dit_and_vae("cpu", 0)
    fresh_dit = {k: v.clone() for k, v in dit.state_dict().items()}
    warm = dev_architecture.warm_start(DEFAULT_WARM_START, ar, dit, vae, "cpu")
    preview = open_checkpoint(DEFAULT_WARM_START)
    source = preview.load_tensors(DIT_PREFIX, "cpu", torch.float32)
    copied = 0
    for name, tensor in dit.state_dict().items():
        if name.startswith(dev_architecture.FRESH_DIT_PREFIXES):
            assert torch.equal(tensor, fresh_dit[name]), name
        else:
            assert torch.equal(tensor, source[name]), name
            copied += 1
    assert copied == warm.copied["dit"] and copied > 90
    assert any(n.startswith("time_caption_embed.image_embedder.") for n in warm.fresh["dit"])
    ar_source = preview.load_tensors("llm_model.", "cpu", torch.float32)
    state = ar.state_dict()
    assert torch.equal(state["model.language_model.layers.0.mlp.gate_proj.weight"],
                       ar_source["model.language_model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(state["gen_head.weight"], ar_source["gen_head.weight"])
    assert torch.all(state["model.language_model.layers.0.self_attn.q_norm.weight"] == 1)


def test_mammothtok_stage_trains_on_what_serving_feeds_it(trained, loaded) -> None:
    tok = loaded.mammothtok
    patch = tok.config.patch_size
    scene = Scene("square", "red", "centre", "large", "blue")
    # The stage's inputs are edit_image's resize and normalisation of the picture...
    served = pixels_from_image(resize_for_mammothtok(dev_stages.picture(scene), factor=patch))
    assert torch.equal(dev_stages.mammothtok_pixels(scene, patch), served)
    # ...and its targets are one code per served patch: a 9x9 grid for a 128x128 picture.
    prompts = dev_stages.Prompts(tok)
    served_codes = prompts.image_ids.ids  # the block builder the planner uses
    targets = dev_stages.patch_codes(scene, patch)
    assert targets.shape == tuple(tok.encode(served).shape[1:]) == (9, 9)
    assert served_codes(torch.from_numpy(targets))  # every target is a visual token the prompt can hold
    red, blue = 0 * 8, 2 * 8  # COLOURS order: red, green, blue, ...
    assert targets[4, 4] == red + 7 and targets[0, 0] == blue  # covered centre, empty corner
    # The loss's nearest code is the quantiser's.
    logits = dev_stages.code_logits(tok, served)
    assert torch.equal(logits.argmax(-1), tok.encode(served))


def png(scene: Scene) -> bytes:
    buffer = io.BytesIO()
    dev_stages.picture(scene).save(buffer, format="PNG")
    return buffer.getvalue()


def test_edit_prompt_ids_are_the_services(trained, loaded) -> None:
    checkpoint = open_checkpoint(trained[0])
    planner = RequestPlanner(loaded, checkpoint, FAMILIES[checkpoint.family], lambda decoding: True)
    prompts = dev_stages.Prompts(loaded.mammothtok)
    edit = split_edits()[0][0]
    instruction = "make the square green"
    plan = planner.plan(prompt=instruction, images=[png(edit.source)])
    assert plan.grid == grid()
    assert list(plan.prompt_ids) == prompts.edit(instruction, edit.source)
    t2i_plan = planner.plan(prompt="a red circle", width=128, height=128)
    assert list(t2i_plan.prompt_ids) == prompts.caption("a red circle")


def test_dit_conditions_are_what_ar_service_streams(loaded) -> None:
    prompts = dev_stages.Prompts(loaded.mammothtok)
    edit = split_edits()[0][0]
    prompt = prompts.edit("move the square to the left", edit.source)
    result = generate_grid(loaded.model, prompt, grid(), loaded.t2i, SamplingParams(temperature=0.0), 0,
                           **prompts.decode_kwargs())
    pool = dev_stages.Pool([prompt], [result.token_ids[:-1]], [edit.target], [edit.source], [edit.kind])
    ((text, image),) = dev_stages.dev_conditions(loaded.model, pool, prompts, "cpu")
    torch.testing.assert_close(text, result.text_condition, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(image, result.image_condition, rtol=1e-4, atol=1e-4)
    assert len(scene_grid_ids(edit.target)) == len(result.token_ids) - 1


def test_batched_references_give_the_dit_s_own_reference_tokens(trained) -> None:
    dit = DiTPipeline.from_checkpoint(open_checkpoint(trained[0])).transformer
    generator = torch.Generator().manual_seed(0)
    b = 3
    latents, refs = (torch.randn(b, 16, 16, 16, generator=generator) for _ in range(2))
    t = torch.rand(b, generator=generator)
    text, image = torch.randn(b, 5, 128, generator=generator), torch.randn(b, 7, 128, generator=generator)
    with torch.no_grad():
        context = dev_stages.batched_context(dit, text, image)
        for i in range(b):
            torch.testing.assert_close(context[i], dit.context(text[i], image[i]), rtol=1e-5, atol=1e-5)
        expected = dit(latents, t, context, references=[[r] for r in refs])
        with dev_stages.batched_references(dit, refs, t, context.shape[1]) as references:
            got = dit(latents, t, context, references=references)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not np.isnan(got.numpy()).any()

    # Training through the batched references moves the reference path's weights as the DiT's own path would.
    weight = dit.ref_image_patch_embedder.weight
    dit.requires_grad_(True)
    try:
        (grad_expected,) = torch.autograd.grad(dit(latents, t, context, references=[[r] for r in refs]).square().mean(),
                                               weight)
        with dev_stages.batched_references(dit, refs, t, context.shape[1]) as references:
            (grad_got,) = torch.autograd.grad(dit(latents, t, context, references=references).square().mean(), weight)
    finally:
        dit.requires_grad_(False)
    assert grad_expected.abs().sum() > 0
    torch.testing.assert_close(grad_got, grad_expected, rtol=1e-4, atol=1e-6)


def test_tokenizer_tensors_are_saved_under_the_released_prefix(trained) -> None:
    names = open_checkpoint(trained[0]).tensor_names(CHECKPOINT_PREFIX)
    assert any(n.endswith("quantize.embedding.weight") for n in names)
