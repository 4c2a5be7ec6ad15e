"""The fast decoder (``StaticDecoder``) on the Dev layout: the Triton kernel that norms, rotates and writes q/k
against plain torch, and the step on the tiny Dev model against the eager decoder.

Without a GPU the Triton kernels run in Triton's interpreter (tests/conftest.py), on CPU tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ar_service.conditions import ALL_GENERATED, PROMPT_TAIL, prompt_ids_for
from ar_service.decoding import Decoding
from ar_service.decoding.decoders import SlotDecoder, decode_together
from ar_service.decoding.stream import DecodeStream
from ar_service.generation import generate_grid
from ar_service.model import decode_kernels
from ar_service.model.configuration import ar_config_from_dict
from ar_service.model.loading import build_random_ar, load_ar
from ar_service.model.modeling import KVCache
from ar_service.model.static_decode import StaticDecoder, _rms_norm, _rotate
from ar_service.model.tiny import TINY_DEV_CONDITION_LAYERS, tiny_dev_llm_config, tiny_t2i, write_ar_only_root
from ar_service.model.tokenizer import IMAGE_END_TOKEN, build_tokenizer
from ar_service.prefill import build_prefix_cache, prefill_prompt, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import RowSampling, SamplingParams, sample_rows
from tests.ar_service import test_decode_kernels, test_decode_memory, test_fp8_ar

triton_only = pytest.mark.skipif(not decode_kernels.available, reason="triton is not installed")

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _reference_qk_norm_rope(qkv, cos, sin, heads, kv_heads, weight, eps):
    """Plain torch, the eager Dev attention's order: view to heads, RMSNorm each q and k head over its head_dim
    values (float32 variance, rounded, times the weight), then RoPE; v as projected."""
    p, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.view(p, heads + 2 * kv_heads, d).split((heads, kv_heads, kv_heads), dim=1)
    q, k = _rms_norm(q, weight[:d], eps), _rms_norm(k, weight[d:], eps)
    return _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None]), v


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 2, 16), (6, 2, 32), (2, 2, 8)])
def test_rope_write_norms_each_q_and_k_head_before_rotating(dtype, heads, kv_heads, d):
    """q lands normed and rotated in q, k normed and rotated in the cache at each row's slot and position, v as it
    came; the q norm's weight applies to q heads and the k norm's to k heads (weights far from one, and the rows'
    scales far apart, so a norm over the wrong values or the wrong weight shows). head_dim is not hidden / heads
    here: the kernel reads it from cos."""
    g = torch.Generator().manual_seed(4)
    p, slots_n, length, eps = 3, 4, 24, 1e-6
    qkv = (torch.randn(p, (heads + 2 * kv_heads) * d, generator=g) * torch.tensor([[0.1], [3.0], [40.0]])).to(dtype)
    weight = (torch.rand(2 * d, generator=g) * 2 + 0.25).to(dtype)
    positions, slots = torch.tensor([5, 17, length - 1]), torch.tensor([2, 0, 3])
    inv = 1.0 / (5e6 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_cache = torch.randn(slots_n, kv_heads, length, d, generator=g).to(dtype)
    v_cache = torch.randn(slots_n, kv_heads, length, d, generator=g).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    q = decode_kernels.rope_write(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads,
                                  qk_norm=(weight, eps))
    q_ref, k_rot, v0 = _reference_qk_norm_rope(qkv, cos, sin, heads, kv_heads, weight, eps)
    for r in range(p):
        k_ref[slots[r], :, positions[r]] = k_rot[r]
        v_ref[slots[r], :, positions[r]] = v0[r]
    torch.testing.assert_close(q, q_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, k_ref, **TOLERANCE[dtype])
    assert torch.equal(v_cache, v_ref)
    # the norm did something: without it the q heads are not these
    plain = decode_kernels.rope_write(qkv, cos, sin, positions, slots, k_cache.clone(), v_cache.clone(), heads, kv_heads)
    assert not torch.allclose(plain.float(), q.float(), atol=1e-2)


@triton_only
def test_rope_write_refuses_a_norm_weight_of_the_wrong_size():
    qkv = torch.zeros(1, 4 * 8)
    cos = sin = torch.zeros(1, 8)
    cache = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    rows = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="2 x 8"):
        decode_kernels.rope_write(qkv, cos, sin, rows, rows, *cache, 2, 1, qk_norm=(torch.ones(8), 1e-6))
    with pytest.raises(ValueError, match="do not hold"):
        decode_kernels.rope_write(torch.zeros(1, 3 * 8), cos, sin, rows, rows, *cache, 2, 1)


# -- the step on the tiny Dev model ---------------------------------------------------------------------------------
# Small grids: the triton kernels run interpreted, and the suite on a few CPU cores.

GRID = grid_for_size(64, 48, 16)  # 4 x 3 visual tokens, 16 tokens with the EOLs and the look-ahead
KERNELS = ["torch", pytest.param("triton", marks=triton_only)]
#: The Preview tests' tolerance for condition states (fast step against eager decoder, float32).
CLOSE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def dev_root(tmp_path_factory):
    return write_ar_only_root(tmp_path_factory.mktemp("ckpt") / "tiny-dev", dev=True)


@pytest.fixture(scope="module")
def dev(dev_root):
    loaded = load_ar(dev_root)
    config = loaded.config
    assert config.member == "dev" and config.qk_norm and not config.attention_bias
    assert not config.final_hidden_normed and config.condition_layers is not None
    return loaded


@pytest.fixture(scope="module")
def setup(dev):
    t2i = dev.t2i
    return dev, SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p), build_prefix_cache(
        dev.model, system_prefix_ids(dev.tokenizer)
    )


@pytest.fixture
def few_splits(monkeypatch):
    """Two attention splits: Triton's interpreter runs programs one by one on the CPU."""
    monkeypatch.setattr(decode_kernels, "ATTENTION_SPLITS", 2)


def _grid(dev, sampling, seed, grid=GRID, prompt="a lighthouse", **kw):
    return generate_grid(dev.model, prompt_ids_for(dev.tokenizer, prompt, grid), grid, dev.t2i, sampling, seed, **kw)


def _random_dev_model(condition_layers: tuple[int, ...], text_vocab_short: int = 0, head_dim: int | None = None,
                      attention_bias: bool = False, seed: int = 3):
    """The tiny Dev AR with random weights (q/k norm weights far from one, biases not zero), its own
    ``gen_condition_layers``, a text vocabulary ``text_vocab_short`` ids short of gen_vocab_start_index
    (gen_vocab_size longer by as much, so that the tiny visual range stays among gen_head's columns), given
    ``head_dim`` heads of that width (q/k/v and o then are not hidden wide), and ``attention_bias`` (Dev's: q, k, v
    and o)."""
    llm = tiny_dev_llm_config()
    text = llm["text_config"]
    text["vocab_size"] -= text_vocab_short
    text["gen_vocab_size"] += text_vocab_short
    llm["gen_vocab_size"] = text["gen_vocab_size"]
    if head_dim is not None:
        quarter = head_dim // 8
        text.update(head_dim=head_dim, rope_scaling={**text["rope_scaling"], "mrope_section": [2 * quarter, quarter, quarter]})
    text["attention_bias"] = attention_bias
    config = ar_config_from_dict({"model_type": "mammothmoda2", "llm_config": llm,
                                  "gen_condition_layers": list(condition_layers)})
    model = build_random_ar(config, "cpu", torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.add_(torch.randn(param.shape, generator=g) * 0.3)
            elif name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=g) * 0.1)
    return model


def test_the_dev_layers_reach_the_step_without_biases_with_their_q_k_norms(dev):
    """What the step reads of a Dev layer: no q/k/v bias, the q and k norms as one vector (re-pointed, so the eager
    model reads the same storage), q/k/v rows of heads * head_dim."""
    static = StaticDecoder(dev.model, 2, 64)
    config = dev.config
    for i, (weights, extras) in enumerate(zip(static._layer_weights, static._layer_extras, strict=True)):
        assert weights[3] is None and extras.o_bias is None
        weight, eps = extras.qk_norm
        attn = dev.model.model.language_model.layers[i].self_attn
        assert weight.shape == (2 * config.head_dim,) and eps == config.rms_norm_eps
        assert attn.q_norm.weight.data_ptr() == weight.data_ptr()
        assert torch.equal(weight[config.head_dim:], attn.k_norm.weight)
        heads = config.num_attention_heads + 2 * config.num_key_value_heads
        assert weights[2].shape == (heads * config.head_dim, config.hidden_size)


@pytest.mark.parametrize(("kernels", "full_length", "scope"), [
    ("torch", False, ALL_GENERATED),
    ("torch", True, PROMPT_TAIL),
    pytest.param("triton", False, PROMPT_TAIL, marks=triton_only),
])
def test_dev_fast_decode_matches_the_eager_decode(setup, few_splits, kernels, full_length, scope):
    """A guided grid: the eager decoder's tokens and condition states, under ardit's default scope and Dev's released
    one (the prompt's generation ids, the grid, then the fed ``<|image end|>``). Interpreted Triton decodes a 3 x 2
    grid (its programs run one by one); the torch kernels the 4 x 3 one."""
    dev, sampling, prefix = setup
    image_end = dev.tokenizer.convert_tokens_to_ids(IMAGE_END_TOKEN) if scope == PROMPT_TAIL else None
    run = dict(prefix=prefix, condition_scope=scope, image_end_id=image_end, guidance=3.0,
               grid=grid_for_size(48, 32, 16) if kernels == "triton" else GRID)
    eager = _grid(dev, sampling, 7, **run)
    static = StaticDecoder(dev.model, slots=4, max_positions=300, full_length=full_length, kernels=kernels)
    fast = _grid(dev, sampling, 7, decoder=SlotDecoder(static), **run)
    assert fast.token_ids == eager.token_ids
    torch.testing.assert_close(fast.image_condition, eager.image_condition, **CLOSE)
    assert static.free_slots == 4


def test_dev_condition_is_the_mean_of_the_kept_entries_with_the_last_one_un_normed():
    """Entries of the hidden-states tuple taken from the eager layers with hooks (entry 0: the embeddings, entry k:
    layer k-1's output, entry N as the last layer left it, before the final norm), averaged: the eager forward's
    condition and the fast step's (this model's list reads entry N, whatever the tiny checkpoint's does)."""
    model = _random_dev_model((-1, -3, 0))
    config, text = model.config, model.model.language_model
    n = len(text.layers)
    entries: list[torch.Tensor] = []
    hooks = [text.layers[0].register_forward_pre_hook(lambda module, args: entries.append(args[0]))]
    hooks += [layer.register_forward_hook(lambda module, args, out: entries.append(out)) for layer in text.layers]
    token = config.gen_id_range.start + 9
    try:
        with torch.inference_mode():
            _, eager = model(torch.tensor([[token]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(entries) == n + 1
    by_hand = torch.stack([entries[i][0, 0] for i in config.condition_layers]).mean(dim=0)
    torch.testing.assert_close(eager[0, 0], by_hand)
    draw = ((config.gen_id_range.start, config.gen_id_range.stop - 1), SamplingParams(), 0, 0)
    _, hidden = StaticDecoder(model, 1, 64).step([0], [token], [0], [draw])
    torch.testing.assert_close(hidden[0], by_hand, **CLOSE)
    normed = torch.stack([text.norm(entries[n])[0, 0], entries[-3][0, 0], entries[0][0, 0]]).mean(dim=0)
    assert not torch.allclose(hidden[0], normed, atol=1e-3)  # the final norm in place of entry N would show


@pytest.mark.parametrize(("kernels", "full_length"), [("torch", True), pytest.param("triton", False, marks=triton_only)])
def test_a_dev_stream_is_batch_invariant_to_the_bit(setup, few_splits, kernels, full_length):
    """A stream's tokens and states alone equal those among three others joining late at other sizes (the torch
    kernels with full_length, the triton ones at any row count)."""
    dev, sampling, prefix = setup
    static = StaticDecoder(dev.model, slots=4, max_positions=300, kernels=kernels, full_length=full_length,
                           fold_norms=kernels == "triton")
    test_decode_kernels.assert_alone_equals_among_late_joiners(dev, static, sampling, prefix)


@triton_only
@pytest.mark.parametrize(("slots", "fold_norms"), [([1], True), ([0, 2], False)])
def test_dev_triton_step_matches_the_torch_step(setup, few_splits, slots, fold_norms):
    test_decode_kernels.test_triton_step_matches_the_torch_step(setup, few_splits, slots, fold_norms)


@pytest.mark.parametrize("kernels", KERNELS)
def test_dev_lanes_in_the_fixed_slots_draw_the_eager_grids(dev, few_splits, kernels):
    """Speculative lanes draw the sequential grid, row-parallel lanes the eager row-parallel grid in as many forwards
    (guided: a lane's unconditional row beside it, so a step of 6 rows takes two passes of the 4 slots), and
    batch-mates of every mode draw their grids alone. Only the row-parallel check takes the 4 x 3 grid (3 x 2 never
    needs two passes); the other grids are smaller (3 x 2, 2 x 2: the speculative windows and the batch-mates' steps
    still overflow the slots), as Triton's interpreter runs its programs one by one."""
    sampling = SamplingParams(1.0, 4, 1.0)
    small, smallest = grid_for_size(48, 32, 16), grid_for_size(32, 32, 16)
    static = StaticDecoder(dev.model, slots=4, max_positions=300, kernels=kernels, shared_slots=True,
                           full_length=kernels == "torch")
    decoder = SlotDecoder(static)
    passes: list[int] = []  # the rows of each step the decoder ran, of lanes or not
    step, step_lanes = static.step, static.step_lanes
    static.step = lambda *args, **kw: passes.append(len(args[0])) or step(*args, **kw)
    static.step_lanes = lambda *args: passes.append(len(args[0])) or step_lanes(*args)

    sequential = _grid(dev, sampling, 11, small, guidance=3.0)
    speculative = _grid(dev, sampling, 11, small, guidance=3.0, decoding=Decoding("speculative", 8), decoder=decoder)
    assert speculative.token_ids == sequential.token_ids
    torch.testing.assert_close(speculative.image_condition, sequential.image_condition, **CLOSE)
    assert speculative.forwards < sequential.forwards

    row_parallel = Decoding("row_parallel", 2)
    eager = _grid(dev, sampling, 5, guidance=3.0, decoding=row_parallel)
    # row-parallel conditions on less of the grid: the test can tell its states from sequential decoding's
    assert (eager.image_condition - _grid(dev, sampling, 5, guidance=3.0).image_condition).abs().max() > 1e-3
    passes.clear()
    fast = _grid(dev, sampling, 5, guidance=3.0, decoding=row_parallel, decoder=decoder)
    assert fast.token_ids == eager.token_ids
    torch.testing.assert_close(fast.image_condition, eager.image_condition, **CLOSE)
    assert fast.forwards == eager.forwards
    assert len(passes) > fast.forwards and max(passes) <= 4  # some forwards took two passes
    assert static.free_slots == 4

    def stream(seed, mode, guidance, grid=GRID):
        s = DecodeStream(dev.model, prompt_ids_for(dev.tokenizer, "a lighthouse", grid), grid, dev.t2i, sampling, seed,
                         reserve=False, guidance=guidance, decoding=mode)
        decoder.admit(s)
        return s

    mates = [stream(7, None, 1.0, smallest), stream(5, row_parallel, 3.0, small),
             stream(8, Decoding("speculative", 4), 1.0, smallest)]
    decode_together(decoder, mates)
    assert mates[1].tokens == _grid(dev, sampling, 5, small, guidance=3.0, decoding=row_parallel).token_ids
    assert mates[0].tokens == _grid(dev, sampling, 7, smallest).token_ids
    assert mates[2].tokens == _grid(dev, sampling, 8, smallest).token_ids
    assert static.free_slots == 4


def test_dev_fp8_weights_decode_as_the_eager_decoder_does(dev_root, monkeypatch):
    """FP8 Dev layers (no biases; the q/k norms stay unquantized) on the torch kernels: the eager decoder's grid."""
    fp8 = load_ar(dev_root, quantization="fp8")
    attn = fp8.model.model.language_model.layers[0].self_attn
    assert attn.q_proj.bias is None and attn.q_norm.weight.dtype == torch.float32
    test_fp8_ar.test_the_fixed_slot_decoder_decodes_the_fp8_model_as_its_eager_decoder_does(fp8, "torch", monkeypatch)


@triton_only
def test_dev_fp8_triton_step_matches_the_fp8_torch_step(dev_root, few_splits, monkeypatch):
    """The triton kernels on FP8 Dev layers (e4m3 weights with their scales, no bias, one image's two rows: the
    dot-free kernel) against the torch step on the same weights. The dot-free kernel takes 16 output columns a
    program here (Triton's interpreter runs programs one by one); at the served ``GEMV_BLOCKS`` it is checked
    value by value in tests/ar_service/test_fp8_ar.py."""
    monkeypatch.setattr(decode_kernels, "GEMV_BLOCKS", (16, *decode_kernels.GEMV_BLOCKS[1:]))
    fp8 = load_ar(dev_root, quantization="fp8")
    torch_step, triton_step = StaticDecoder(fp8.model, 2, 64), StaticDecoder(fp8.model, 2, 64, kernels="triton")
    assert all(scales is not None for scales in triton_step._layer_scales)
    allowed = fp8.config.gen_id_range
    for t in range(2):
        draws = [((allowed.start, allowed.stop - 1), SamplingParams(1.0, 50, 1.0), 7 + k, t) for k in range(2)]
        ids, positions = [allowed.start + 3 + t, allowed.start + 9 + t], [4 + t, 7 + t]
        a = torch_step.step([0, 1], ids, positions, draws)
        b = triton_step.step([0, 1], ids, positions, draws)
        assert a[0] == b[0]
        torch.testing.assert_close(b[1], a[1], **CLOSE)


# -- a Dev config at the edges the released code allows: the id skew, heads not hidden / heads wide, biases --------

SKEW = 8
WIDE_HEAD = 32  # 4 heads of 32: q is 128 wide, the hidden state 64


@pytest.fixture(scope="module")
def edge_dev():
    """The tiny Dev AR with its text vocabulary 8 ids short of gen_vocab_start_index (Dev's 151936 against 152064 at
    toy size): gen_head's column c is id vocab_size + c, embedded as gen row c - 8. Its heads are 32 wide (not
    hidden / heads = 16), and its config sets attention_bias (q, k, v and o biased)."""
    model = _random_dev_model(TINY_DEV_CONDITION_LAYERS, text_vocab_short=SKEW, head_dim=WIDE_HEAD, attention_bias=True)
    config = model.config
    assert config.gen_vocab_start_index - config.gen_logit_start == SKEW
    assert config.num_attention_heads * config.head_dim == 2 * config.hidden_size
    assert config.o_proj_bias and model.model.language_model.layers[0].self_attn.o_proj.bias is not None
    with torch.no_grad():
        model.gen_head.weight.mul_(8)  # sharper logits: the draws depend on which column is which id
    t2i = tiny_t2i()
    assert t2i.visual_token_end_id <= config.gen_id_range.stop
    grid = grid_for_size(48, 32, 16)
    # text ids below the (shortened) text vocabulary, then the prompt's generation-vocabulary tail
    prompt = [*range(3, 40), *prompt_ids_for(build_tokenizer(), "a cat", grid)[-2:]]
    assert all(i < config.vocab_size or i >= config.gen_vocab_start_index for i in prompt)
    return model, t2i, grid, prompt


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_skewed_step_draws_gen_logit_start_plus_the_column(edge_dev, few_splits, kernels):
    """Step by step against the eager decode forward and the sampler at the released mapping (id = gen_logit_start +
    column), each drawn id fed back (embedded as gen row id - gen_vocab_start_index): the same ids and states, with
    heads wider than hidden / heads and every attention projection biased; drawing from gen_vocab_start_index
    instead would have given other ids."""
    model, t2i, _, prompt = edge_dev
    config = model.config
    sampling = SamplingParams(1.0, 0, 1.0)
    allowed = (t2i.visual_token_start_id, t2i.visual_token_end_id - 1)
    with torch.inference_mode():
        _, _, cache = prefill_prompt(model, prompt, KVCache(capacity=len(prompt) + 8))
        static = StaticDecoder(model, 2, 64, kernels=kernels)
        assert static._layer_weights[0][3] is not None and static._layer_extras[0].o_bias is not None
        slot = static.admit(cache)
        token, shifted = t2i.visual_token_start_id + 3, 0
        for step in range(6):
            position = len(prompt) + step
            rows = RowSampling.build([(allowed, sampling, 11, step)], "cpu")
            logits, hidden = model.decode([token], [position], [cache])
            expected = sample_rows(logits, config.gen_logit_start, rows).item()
            shifted += expected != sample_rows(logits, config.gen_vocab_start_index, rows).item()
            drawn, fast_hidden = static.step([slot], [token], [position], [(allowed, sampling, 11, step)])
            assert drawn == [expected]
            torch.testing.assert_close(fast_hidden[0], hidden[0], **CLOSE)
            token = expected
    assert shifted  # the mapping mattered


@pytest.mark.parametrize("lanes", [False, True])
def test_the_decode_memory_arithmetic_holds_for_dev_shapes(dev, edge_dev, lanes):
    """The K/V per slot (kv heads x head_dim) is what the decoder allocates, and the step workspace estimate (q
    wider than hidden, the q/k norms' float32 temporaries) bounds a torch-kernel step's peak, for the tiny Dev AR and
    the one with wide heads."""
    for loaded in (dev, SimpleNamespace(model=edge_dev[0], config=edge_dev[0].config)):
        test_decode_memory.test_per_slot_bytes_are_what_the_static_decoder_allocates(loaded, 4, 333)
        test_decode_memory.test_the_step_workspace_estimate_bounds_what_a_step_allocates(loaded, 8, 1200, lanes)


def test_a_skewed_grid_is_the_same_from_the_eager_and_the_fixed_slot_decoders(edge_dev, few_splits):
    """A whole guided grid of the skewed model: both decoders turn gen_head column c into id gen_logit_start + c (the
    released logit-index-is-the-id rule), so the eager and the fixed-slot grids agree id for id, every id a visual
    token or an EOL."""
    model, t2i, grid, prompt = edge_dev
    sampling = SamplingParams(1.0, 0, 1.0)
    with torch.inference_mode():
        eager = generate_grid(model, prompt, grid, t2i, sampling, 5, guidance=3.0)
        static = StaticDecoder(model, slots=2, max_positions=len(prompt) + 2 * grid.decode_tokens, kernels="torch")
        fast = generate_grid(model, prompt, grid, t2i, sampling, 5, guidance=3.0, decoder=SlotDecoder(static))
    assert fast.token_ids == eager.token_ids
    visual = range(t2i.visual_token_start_id, t2i.visual_token_end_id)
    assert all(token in visual or token == t2i.eol_token_id for token in eager.token_ids)
