"""The Flax Llama over the paged pool equals Hugging Face's PyTorch Llama in float32, in both
forms: layers stacked (as loaded; GPU, TPU, tensor parallelism) and unstacked (one CPU device)."""

import numpy as np
import pytest
import torch

from jaxpaged.kv_cache import init_kv_pool
from jaxpaged.loader import load_model
from paged import dot_precisions, step_metadata

BS = 4  # small blocks, so sequences span many blocks


@pytest.fixture(params=["stacked", "unstacked", "unstacked_out_in"])
def form(request):
    return request.param


def model_in(lm, form):
    if form == "stacked":
        return lm.model
    model = lm.model.unstacked("out_in" if form == "unstacked_out_in" else "in_out")
    assert not model.is_stacked
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def new_pool(cfg, num_blocks):
    return init_kv_pool(cfg.num_layers, num_blocks, cfg.num_kv_heads, BS, cfg.head_dim)


def test_prefill_logits_match_hf(tiny_hf, form):
    folder, hf = tiny_hf
    lm = load_model(folder, dtype=np.float32, attention_backend="reference")  # not the GPU default, bf16
    model = model_in(lm, form)
    ids = np.random.default_rng(1).integers(0, lm.config.vocab_size, 23).tolist()
    md = step_metadata([0], [len(ids)], block_size=BS, blocks_per_seq=8)
    logits, _ = model(np.array(ids, np.int32), new_pool(lm.config, 9), md)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_batched_prefill_then_decode_matches_each_sequence_alone(tiny_hf, form):
    """Three sequences of different lengths share one pool: a packed prefill, then decode steps."""
    folder, hf = tiny_hf
    lm = load_model(folder, dtype=np.float32, attention_backend="reference")  # not the GPU default, bf16
    model = model_in(lm, form)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, lm.config.vocab_size, n).tolist() for n in (5, 11, 2)]
    per_seq = 8
    kv = new_pool(lm.config, 1 + per_seq * len(seqs))
    # Prefill all three in one step, with padding tokens and a padding row, as the engine pads.
    md = step_metadata([0] * 3, [len(s) for s in seqs], block_size=BS, blocks_per_seq=per_seq,
                       pad_tokens=3, pad_seqs=1)
    tokens = np.array(sum(seqs, []) + [0, 0, 0], np.int32)
    last = np.cumsum([len(s) for s in seqs]) - 1
    logits, kv = model(tokens, kv, md, logits_indices=np.asarray(last, np.int32))
    for step in range(5):
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(np.asarray(logits[i]), hf_logits(hf, s)[-1], atol=1e-4, rtol=0,
                                       err_msg=f"sequence {i}, step {step}")
        nxt = [int(rng.integers(0, lm.config.vocab_size)) for _ in seqs]
        md = step_metadata([len(s) for s in seqs], [1] * 3, block_size=BS, blocks_per_seq=per_seq)
        logits, kv = model(np.array(nxt, np.int32), kv, md)
        for s, t in zip(seqs, nxt):
            s.append(t)


def test_one_token_steps_match_hf(tiny_hf, form):
    """A single sequence decoded one token a step: the shape of single-stream decode, whose
    CPU projections split their contraction (see ``model._cpu_dot``)."""
    folder, hf = tiny_hf
    lm = load_model(folder, dtype=np.float32, attention_backend="xla")
    model = model_in(lm, form)
    ids = np.random.default_rng(4).integers(0, lm.config.vocab_size, 9).tolist()
    kv = new_pool(lm.config, 9)
    for i, t in enumerate(ids):
        md = step_metadata([i], [1], block_size=BS, blocks_per_seq=8)
        logits, kv = model(np.array([t], np.int32), kv, md)
        np.testing.assert_allclose(np.asarray(logits[0]), hf_logits(hf, ids[:i + 1])[-1], atol=1e-4, rtol=0,
                                   err_msg=f"token {i}")


@pytest.mark.parametrize("rows,k,n,halves", [(1, 576, 576, True), (1, 1536, 576, False), (2, 1536, 576, True),
                                              (32, 1536, 576, True), (33, 1536, 576, False),
                                              (8, 576, 1536, False), (8, 1535, 575, False)])
def test_cpu_dot_takes_the_two_halves_where_its_rule_says(rows, k, n, halves):
    """Which float32 ``[out, in]`` products run as a batch of the weight's two row halves: one
    row over a small weight (<= ``ONE_THREAD_MATVEC_MAX`` elements), or 2 to
    ``TALL_HALVES_MAX_ROWS`` rows over a weight with more inputs than outputs (an even count of
    them); every other product is one plain dot."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.model import _cpu_dot

    x, w = jnp.zeros((rows, k), jnp.float32), jnp.zeros((n, k), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, w: _cpu_dot(x, w, out_in=True, precision=None))(x, w)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    (_, (batch_lhs, _)) = dots[0].params["dimension_numbers"]
    assert bool(batch_lhs) == halves, dots[0]


@pytest.mark.parametrize("out_in", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 96), (1536, 96), (30, 96), (576, 95), (1024, 1024)])
def test_cpu_dot_equals_the_plain_product(k, n, dtype, out_in):
    """One row (split contraction when ``k`` divides and the weight is ``[in, out]``; two row
    halves in a batch when the weight is ``[out, in]``, ``n`` even and the weight small, plain
    otherwise: 95 columns, or 1024 x 1024 > ``ONE_THREAD_MATVEC_MAX``) and several rows
    (plain, or two row halves when the weight is ``[out, in]`` with more inputs than outputs and
    the rows at most ``TALL_HALVES_MAX_ROWS``), either layout, against numpy in float64, at the
    dtype's precision (bfloat16: the partial sums are added in float32)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.model import TALL_HALVES_MAX_ROWS, _cpu_dot

    rng = np.random.default_rng(k + n)
    dt, tol = (jnp.float32, 1e-5) if dtype == "float32" else (jnp.bfloat16, 1e-2)
    w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32), dt)
    for rows in (1, 3, TALL_HALVES_MAX_ROWS, TALL_HALVES_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((rows, k), dtype=np.float32), dt)
        got = _cpu_dot(x, w.T if out_in else w, out_in=out_in, precision=jax.lax.Precision.HIGHEST)
        assert got.dtype == dt
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.sqrt(k))


@pytest.mark.parametrize("out_in", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 32, 40])
def test_cpu_dot_of_16bit_weights_rounds_only_the_input(rows, out_in):
    """float32 activations times bfloat16 weights (the CPU form of a bfloat16 model): the
    activations rounded to bfloat16, the products summed in float32; fewer rows than
    ``MIN_ROWS_16BIT`` are padded (with ``[out, in]`` weights and at most
    ``WEIGHT_LHS_MAX_ROWS_16BIT`` rows, as ``w @ x^T``), and the padding leaves the rows'
    results alone. Against numpy in float64 on the same rounded inputs, at float32's precision."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.model import MIN_ROWS_16BIT, WEIGHT_LHS_MAX_ROWS_16BIT, _cpu_dot

    assert 5 <= WEIGHT_LHS_MAX_ROWS_16BIT < 32 <= MIN_ROWS_16BIT <= 40  # the rows cover every form
    k = 576
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((k, 96), dtype=np.float32), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, k), dtype=np.float32))
    got = _cpu_dot(x, w.T if out_in else w, out_in=out_in, precision=jax.lax.Precision.HIGHEST)
    assert got.dtype == jnp.float32 and got.shape == (rows, 96)
    rounded = np.asarray(x.astype(jnp.bfloat16), np.float64)
    want = rounded @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    # The input is rounded: the float32 product differs from it by far more than float32 sums do.
    assert np.max(np.abs(np.asarray(x, np.float64) @ np.asarray(w, np.float64) - want)) > 1e-3


def test_a_bfloat16_models_cpu_form_keeps_float32_activations(tiny_hf):
    """On CPU a bfloat16 model runs with float32 activations; only the matmuls' inputs are
    rounded to bfloat16. Its logits are closer to the float32 model over the same (bf16)
    weights than the all-bfloat16 forward of the stacked form (the accelerators' arithmetic),
    and within bfloat16 rounding of them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    folder, _ = tiny_hf
    lm16 = load_model(folder, dtype=jnp.bfloat16, attention_backend="xla")
    graphdef, state = nnx.split(lm16.model)  # the float32 reference holds the bf16 model's values exactly
    ref_model = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float32), state))
    assert ref_model.dtype == jnp.float32 and ref_model.is_stacked
    ids = np.random.default_rng(7).integers(0, lm16.config.vocab_size, 23).tolist()
    md = step_metadata([0], [len(ids)], block_size=BS, blocks_per_seq=8)
    tokens = np.array(ids, np.int32)

    def logits_of(model):
        kv = init_kv_pool(lm16.config.num_layers, 9, lm16.config.num_kv_heads, BS, lm16.config.head_dim)
        return np.asarray(model(tokens, kv, md)[0], np.float64)

    want = logits_of(ref_model)
    errs = {}
    for layout in ("in_out", "out_in"):
        errs[layout] = np.max(np.abs(logits_of(lm16.model.unstacked(layout)) - want))
    all_bf16 = np.max(np.abs(logits_of(lm16.model) - want))
    scale = np.max(np.abs(want))
    assert max(errs.values()) < 2e-2 * scale, (errs, scale)
    assert max(errs.values()) < 0.75 * all_bf16, (errs, all_bf16)


def test_chunked_prefill_matches_hf(tiny_hf, form):
    """A prompt fed in chunks that start mid-block attends to its cached prefix."""
    folder, hf = tiny_hf
    lm = load_model(folder, dtype=np.float32, attention_backend="reference")  # not the GPU default, bf16
    model = model_in(lm, form)
    ids = np.random.default_rng(3).integers(0, lm.config.vocab_size, 19).tolist()
    kv = new_pool(lm.config, 9)
    done = 0
    for chunk in (6, 7, 6):
        md = step_metadata([done], [chunk], block_size=BS, blocks_per_seq=8)
        logits, kv = model(np.array(ids[done:done + chunk], np.int32), kv, md)
        done += chunk
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids)[-6:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_matmuls_ask_for_full_precision(tiny_hf, dtype, form):
    """On GPU the default multiplies float32 in TF32 (~1e-3 relative error); a float32
    model must ask for HIGHEST in every projection and the LM head (and the attention
    it calls). bfloat16 leaves the choice to ``jax.default_matmul_precision``."""
    import jax
    import jax.numpy as jnp

    folder, _ = tiny_hf
    lm = load_model(folder, dtype=getattr(jnp, dtype), attention_backend="xla")
    model = model_in(lm, form)
    md = step_metadata([0], [5], block_size=BS, blocks_per_seq=2)
    pool = init_kv_pool(lm.config.num_layers, 3, lm.config.num_kv_heads, BS, lm.config.head_dim,
                        getattr(jnp, dtype))
    jaxpr = jax.make_jaxpr(lambda t, kv: model(t, kv, md))(np.arange(5, dtype=np.int32), pool).jaxpr
    kinds = [None if p is None else set(p) for p in dot_precisions(jaxpr)]
    highest = {jax.lax.Precision.HIGHEST}
    # The LM head and the layers' projections: 7 in the stacked scan body; 4 per layer in the
    # unstacked form's switch branches (q/k/v and gate/up fused). The xla attention path's own
    # dots compute in float32 whatever the pool's dtype.
    model_dots = 1 + (7 if form == "stacked" else 4 * lm.config.num_layers)
    if dtype == "float32":
        assert len(kinds) >= model_dots and all(k == highest for k in kinds), kinds
    else:  # the model's dots follow jax.default_matmul_precision
        assert kinds.count(None) == model_dots and all(k in (None, highest) for k in kinds), kinds


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_unstacked_layers_are_the_stacked_ones(tiny_hf, layout):
    """Layer i's fused arrays hold exactly layer i's weights, in q, k, v and gate, up order
    (``[in, out]``, or transposed for ``"out_in"``)."""
    lm = load_model(tiny_hf[0], dtype=np.float32)
    stack, cfg = lm.model.layers, lm.config
    D = cfg.hidden_size

    def laid_out(w):
        return w.T if layout == "out_in" else w

    for i, p in enumerate(lm.model.unstacked(layout).layers):
        assert p.out_in == (layout == "out_in")
        q, k, v = (np.asarray(getattr(stack, n)[...][i]).reshape(D, -1) for n in ("wq", "wk", "wv"))
        np.testing.assert_array_equal(np.asarray(p.wqkv[...]), laid_out(np.concatenate([q, k, v], axis=1)))
        gate, up = np.asarray(stack.w_gate[...][i]), np.asarray(stack.w_up[...][i])
        np.testing.assert_array_equal(np.asarray(p.w_gate_up[...]), laid_out(np.concatenate([gate, up], axis=1)))
        np.testing.assert_array_equal(np.asarray(p.wo[...]), laid_out(np.asarray(stack.wo[...][i]).reshape(-1, D)))
        np.testing.assert_array_equal(np.asarray(p.w_down[...]), laid_out(np.asarray(stack.w_down[...][i])))
        np.testing.assert_array_equal(np.asarray(p.input_norm[...]), np.asarray(stack.input_norm[...][i]))
    with pytest.raises(ValueError, match="layout 'row_major' is not one of"):
        lm.model.unstacked("row_major")


def test_cpu_layout_is_chosen_by_timing_once(monkeypatch):
    """``choose_cpu_layout``: test-sized layers take ``"in_out"`` untimed; bigger ones take
    ``"out_in"`` only when it is >= 5% faster in the geometric mean over the timed step sizes,
    and the choice is timed once per process and shape."""
    import jax.numpy as jnp

    from jaxpaged import model as model_mod
    from jaxpaged.config import LlamaConfig

    calls = []
    speed = {}

    def fake_times(shapes, dtype, tokens, reps):
        calls.append(shapes)
        return {t: {"in_out": 1.0, "out_in": speed[t]} for t in tokens}

    monkeypatch.setattr(model_mod, "time_cpu_layouts", fake_times)
    monkeypatch.setattr(model_mod, "_LAYOUT_CHOICES", {})
    tiny = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16)
    assert model_mod.choose_cpu_layout(tiny, jnp.float32) == "in_out" and not calls
    tokens = model_mod._LAYOUT_TOKENS
    cases = [  # (out_in / in_out per step size, choice)
        ([0.5] * len(tokens), "out_in"),
        ([1.0] * (len(tokens) - 1) + [0.7], "out_in"),  # geometric mean 0.915
        ([0.96] * len(tokens), "in_out"),  # faster, but not by 5%
        ([0.7] + [1.3] * (len(tokens) - 1), "in_out"),
    ]
    for i, (ratios, want) in enumerate(cases):
        speed.update(zip(tokens, ratios))
        cfg = LlamaConfig(vocab_size=128, hidden_size=512 + 64 * i, intermediate_size=2048, num_layers=2,
                          num_heads=8, num_kv_heads=2, head_dim=64)
        assert model_mod.choose_cpu_layout(cfg, jnp.float32) == want, ratios
        assert model_mod.choose_cpu_layout(cfg, jnp.float32) == want
        assert len(calls) == i + 1  # the second call used the first one's choice


def test_cpu_layout_timing_runs_both_layouts():
    """The timing behind ``choose_cpu_layout`` itself, on small shapes: a positive time per
    layout and step size."""
    import jax.numpy as jnp

    from jaxpaged.model import time_cpu_layouts

    times = time_cpu_layouts(((64, 96), (32, 64), (64, 128), (64, 64)), jnp.float32, (1, 5), reps=2)
    assert set(times) == {1, 5}
    assert all(set(t) == {"in_out", "out_in"} and min(t.values()) > 0 for t in times.values())


@pytest.mark.cpu_host
def test_engines_over_one_cpu_model_share_its_unstacked_form(tiny_hf):
    """On one CPU device an engine runs the unstacked form; engines over the same loaded model
    share one copy of it (not one each), and the caller's model keeps its stack."""
    from jaxpaged import LLM
    from jaxpaged.loader import shard_model

    lm = load_model(tiny_hf[0], dtype=np.float32)
    a, b = LLM(lm, num_blocks=16), LLM(lm, num_blocks=16, attention_backend="reference")
    assert lm.model.is_stacked and not a.loaded.model.is_stacked and not b.loaded.model.is_stacked
    assert a.loaded.model.layers[1].wqkv[...] is b.loaded.model.layers[1].wqkv[...]
    assert a.loaded.model.embed[...] is lm.model.embed[...]  # what is not per layer is shared
    assert shard_model(a.loaded.model, 1) is a.loaded.model
    with pytest.raises(ValueError, match="unstacked for one CPU device"):
        shard_model(a.loaded.model, 2)


@pytest.mark.cpu_host
def test_engine_gives_the_same_tokens_in_either_cpu_layout(tiny_hf, monkeypatch):
    """An engine takes the layout ``choose_cpu_layout`` picks for this machine; both give the
    same greedy tokens (the layouts differ in float32 rounding only), and engines over one
    model share one copy of each form."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged import model as model_mod

    lm = load_model(tiny_hf[0], dtype=np.float32)
    prompts = [np.random.default_rng(i).integers(0, lm.config.vocab_size, 5 + 3 * i).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for layout in model_mod.CPU_LAYOUTS:
        monkeypatch.setattr(model_mod, "choose_cpu_layout", lambda cfg, dtype, layout=layout: layout)
        llm = LLM(lm, num_blocks=32)
        assert llm.loaded.model.layers[0].out_in == (layout == "out_in")
        assert LLM(lm, num_blocks=32).loaded.model is llm.loaded.model
        tokens[layout] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["in_out"] == tokens["out_in"]
