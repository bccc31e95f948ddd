"""The KV pool's in-place updates: write, copy-on-write, swap, and donation of the step.

"In place" is checked on the compiled program: the donated pool is aliased to the output
(``input_output_alias`` in the compiled HLO), no instruction copies a pool-sized array,
and the temporary memory XLA plans does not grow with the number of blocks.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.attention import AttentionMetadata, paged_attention
from jaxpaged.kv_cache import (NULL_BLOCK, KVPool, copy_blocks, gather_blocks, init_kv_pool,
                               resolve_kv_cache_dtype, scatter_blocks, write_kv)

L, KVH, BS, D = 3, 2, 8, 16


def random_pool(num_blocks, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shape = (L, num_blocks, KVH, BS, D)
    return KVPool(jnp.asarray(rng.standard_normal(shape), dtype),
                  jnp.asarray(rng.standard_normal(shape), dtype))


def i32(x):
    return jnp.asarray(x, jnp.int32)


# ---------------------------------------------------------------- semantics


def test_write_kv_puts_each_token_in_its_slot_of_its_layer():
    kv = init_kv_pool(L, 6, KVH, BS, D)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, KVH, D)).astype(np.float32)
    v = rng.standard_normal((3, KVH, D)).astype(np.float32)
    slots = [4 * BS + 7, 2 * BS + 0, NULL_BLOCK * BS + 0]  # last token: padding -> null block
    out = write_kv(kv, i32(1), jnp.asarray(k), jnp.asarray(v), i32(slots))
    expect_k = np.zeros(kv.k.shape, np.float32)
    expect_v = np.zeros(kv.v.shape, np.float32)
    for t, slot in enumerate(slots):
        expect_k[1, slot // BS, :, slot % BS] = k[t]
        expect_v[1, slot // BS, :, slot % BS] = v[t]
    np.testing.assert_array_equal(out.k, expect_k)
    np.testing.assert_array_equal(out.v, expect_v)


def test_write_kv_of_one_token_touches_only_its_slot_and_the_null_block():
    kv = random_pool(6, seed=4)
    k = jnp.full((1, KVH, D), 7.0)
    out = write_kv(kv, i32(2), k, k + 1, i32([3 * BS + 5]))
    for got, old, val in ((out.k, kv.k, 7.0), (out.v, kv.v, 8.0)):
        got, want = np.asarray(got), np.array(old)
        want[2, 3, :, 5] = val
        np.testing.assert_array_equal(got[:, 1:], want[:, 1:])  # every real block, every layer


def test_write_kv_casts_to_the_pool_dtype():
    kv = init_kv_pool(L, 4, KVH, BS, D, dtype=jnp.bfloat16)
    out = write_kv(kv, i32(0), jnp.ones((1, KVH, D)), jnp.ones((1, KVH, D)), i32([BS + 1]))
    assert out.k.dtype == jnp.bfloat16
    assert float(out.k[0, 1, 0, 1, 0]) == 1.0


def test_copy_blocks_copies_every_layer_and_padding_pairs_do_nothing():
    kv = random_pool(8)
    src, dst = i32([2, 5, 0, 0]), i32([6, 3, 0, 0])  # two real pairs, two null -> null pads
    out = copy_blocks(kv, src, dst)
    for a, b in ((kv.k, out.k), (kv.v, out.v)):
        expect = np.array(a)
        expect[:, 6], expect[:, 3] = expect[:, 2], expect[:, 5]
        np.testing.assert_array_equal(b, expect)


def test_copy_blocks_reads_all_sources_before_writing():
    kv = random_pool(4)
    out = copy_blocks(kv, i32([1, 2]), i32([2, 1]))  # a swap
    np.testing.assert_array_equal(out.k[:, 1], kv.k[:, 2])
    np.testing.assert_array_equal(out.k[:, 2], kv.k[:, 1])


def test_gather_then_scatter_restores_swapped_blocks():
    kv = random_pool(8)
    ids = i32([5, 2, 7, NULL_BLOCK])  # last entry: padding
    k_host, v_host = jax.device_get(gather_blocks(kv, ids))  # swap out to host memory
    assert k_host.shape == (L, 4, KVH, BS, D)
    np.testing.assert_array_equal(k_host[:, 1], kv.k[:, 2])
    wiped = KVPool(kv.k.at[:, 1:].set(0.0), kv.v.at[:, 1:].set(0.0))
    back = scatter_blocks(wiped, ids, (jnp.asarray(k_host), jnp.asarray(v_host)))  # swap in
    for blk in (5, 2, 7):
        np.testing.assert_array_equal(back.k[:, blk], kv.k[:, blk])
        np.testing.assert_array_equal(back.v[:, blk], kv.v[:, blk])
    np.testing.assert_array_equal(back.k[:, 3], 0.0)  # untouched


def test_scatter_blocks_checks_the_data_shape():
    kv = random_pool(4)
    with pytest.raises(ValueError, match="does not hold 2 blocks"):
        scatter_blocks(kv, i32([1, 2]), (kv.k[:, :3], kv.v[:, :3]))


# ---------------------------------------------------------------- in place under donation


def pool_shape_text(kv):
    dt = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16"}[kv.k.dtype]
    return f"{dt}[{','.join(map(str, kv.k.shape))}]"


def assert_in_place(compiled, kv):
    """Both pool arrays (parameters 0 and 1) alias outputs; nothing copies a whole pool."""
    hlo = compiled.as_text()
    alias = re.search(r"input_output_alias=\{([^\n]*)\}", hlo)
    assert alias, "no input_output_alias in the compiled module"
    aliased_params = {int(p) for p in re.findall(r"\(\s*(\d+)\s*,\s*\{\}", alias.group(1))}
    assert {0, 1} <= aliased_params, f"pool not aliased: {alias.group(0)}"
    shape = re.escape(pool_shape_text(kv))
    copies = re.findall(rf"= {shape}\{{[^}}]*\}} copy\(", hlo)
    assert not copies, f"the compiled step copies the pool: {copies}"


def test_copy_and_scatter_blocks_are_in_place_under_donation():
    kv = random_pool(64)
    pairs = i32([3, 0]), i32([9, 0])
    copy = jax.jit(copy_blocks, donate_argnums=0)
    lowered = copy.trace(kv, *pairs).lower()
    assert lowered.as_text().count("tf.aliasing_output") == 2
    assert_in_place(lowered.compile(), kv)

    data = gather_blocks(kv, i32([4, 0]))
    scatter = jax.jit(scatter_blocks, donate_argnums=0)
    assert_in_place(scatter.trace(kv, i32([4, 0]), data).lower().compile(), kv)


def make_step(backend, decode_only, num_layers=L):
    """One model-like step: a scan over layers writing K/V then attending, the pool carried."""

    def step(kv, q, k, v, md):
        def layer_fn(kv, xs):
            layer, q_l, k_l, v_l = xs
            kv = write_kv(kv, layer, k_l, v_l, md.slot_mapping)
            o = paged_attention(q_l, kv, layer, md, scale=D ** -0.5, backend=backend)
            return kv, o

        layers = jnp.arange(num_layers, dtype=jnp.int32)
        return jax.lax.scan(layer_fn, kv, (layers, q, k, v))

    return jax.jit(step, donate_argnums=0)


def step_inputs(num_blocks, decode_only, seed=0):
    """Two sequences (+1 padding row) of the pool; decode: one token each, else a chunk."""
    rng = np.random.default_rng(seed)
    kv = random_pool(num_blocks, seed)
    tables = i32([[3, 5, 0, 0], [7, 0, 0, 0], [0, 0, 0, 0]])
    if decode_only:
        ctx, pos, qsl = [13, 2, 0], [12, 1, 0], [0, 1, 2, 2]
    else:
        ctx, pos, qsl = [13, 2, 0], [9, 10, 11, 12, 0, 1, 0, 0], [0, 4, 6, 6]
    pos = np.asarray(pos)
    seq = np.searchsorted(np.asarray(qsl), np.arange(len(pos)), side="right") - 1
    real = np.arange(len(pos)) < qsl[-1]
    blk = np.where(real, np.asarray(tables)[np.clip(seq, 0, 2), pos // BS], NULL_BLOCK)
    slots = np.where(real, blk * BS + pos % BS, 0)
    md = AttentionMetadata(positions=i32(pos), slot_mapping=i32(slots), block_tables=tables,
                           context_lens=i32(ctx), query_start_loc=i32(qsl), decode_only=decode_only)
    T, Hq = len(pos), 3 * KVH
    q = jnp.asarray(rng.standard_normal((L, T, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, T, KVH, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, T, KVH, D)), jnp.float32)
    return kv, q, k, v, md


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "ragged"])
@pytest.mark.parametrize("backend", ["xla", "pallas", "reference"])
def test_step_updates_the_donated_pool_in_place(backend, decode_only):
    args = step_inputs(64, decode_only)
    lowered = make_step(backend, decode_only).trace(*args).lower()
    assert lowered.as_text().count("tf.aliasing_output") == 2  # k and v of the pool
    assert_in_place(lowered.compile(), args[0])


@pytest.mark.parametrize("backend,num_seqs,num_tokens,width,decode_only", [
    ("xla", 1, 1, 32, True), ("xla", 1, 1, 32, False), ("xla", 4, 64, 16, False), ("pallas", 1, 1, 32, True),
    ("pallas", 1, 1, 32, False)])
def test_model_step_never_copies_the_pool(backend, num_seqs, num_tokens, width, decode_only):
    """The whole Llama (layer scan, K/V writes, attention loops) compiled with the pool donated:
    no copy of it anywhere. A one-token step used to get eight (see ``write_kv``)."""
    from flax import nnx

    from jaxpaged.config import LlamaConfig
    from jaxpaged.model import Llama

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    graphdef, params = nnx.split(Llama(cfg, attention_backend=backend, rngs=nnx.Rngs(0)))
    shape = (cfg.num_layers, 64, cfg.num_kv_heads, 16, cfg.head_dim)
    kv = KVPool(jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.float32))
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(positions=spec(num_tokens), slot_mapping=spec(num_tokens),
                           block_tables=spec(num_seqs, width), context_lens=spec(num_seqs),
                           query_start_loc=spec(num_seqs + 1), decode_only=decode_only)
    step = jax.jit(lambda p, kv, tokens, md: nnx.merge(graphdef, p)(tokens, kv, md), donate_argnums=1)
    hlo = step.lower(params, kv, spec(num_tokens), md).compile().as_text()
    shape_text = re.escape(f"f32[{','.join(map(str, shape))}]")
    assert not re.findall(rf"= {shape_text}\{{[^}}]*\}} copy\(", hlo), "the compiled step copies the pool"
    assert "input_output_alias" in hlo


def test_kv_cache_dtype_auto_is_the_models_but_float32_for_16_bit_on_cpu():
    assert resolve_kv_cache_dtype("auto", jnp.bfloat16, "cpu") == jnp.float32
    assert resolve_kv_cache_dtype("auto", jnp.float16, "cpu") == jnp.float32
    assert resolve_kv_cache_dtype("auto", jnp.float32, "cpu") == jnp.float32
    for platform in ("gpu", "tpu"):
        assert resolve_kv_cache_dtype("auto", jnp.bfloat16, platform) == jnp.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", jnp.float32, "cpu") == jnp.uint16  # its bits (test_kv_fp8.py)
    assert resolve_kv_cache_dtype("bfloat16", jnp.float32, "gpu") == jnp.bfloat16
    assert resolve_kv_cache_dtype("float32", jnp.bfloat16, "tpu") == jnp.float32
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        resolve_kv_cache_dtype("int8", jnp.float32, "cpu")


def test_a_bfloat16_models_step_over_its_cpu_pool_keeps_temp_memory_flat():
    """The step of a bfloat16 model over the pool ``kv_cache_dtype="auto"`` gives it on CPU:
    XLA's temporary memory does not grow with the pool. Over a bfloat16 pool it grows by a
    float32 copy of the pool, which each layer's K/V write converted and back."""
    from flax import nnx

    from jaxpaged.config import LlamaConfig
    from jaxpaged.model import Llama

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    graphdef, params = nnx.split(Llama(cfg, dtype=jnp.bfloat16, attention_backend="xla", rngs=nnx.Rngs(0)))
    pool_dtype = resolve_kv_cache_dtype("auto", jnp.bfloat16, jax.devices()[0].platform)
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(positions=spec(4), slot_mapping=spec(4), block_tables=spec(4, 8), context_lens=spec(4),
                           query_start_loc=spec(5), decode_only=True)
    step = jax.jit(lambda p, kv, tokens, md: nnx.merge(graphdef, p)(tokens, kv, md), donate_argnums=1)
    temp = {}
    for nb in (64, 1024):
        pool = jax.ShapeDtypeStruct((cfg.num_layers, nb, cfg.num_kv_heads, 16, cfg.head_dim), pool_dtype)
        compiled = step.lower(params, KVPool(pool, pool), spec(4), md).compile()
        temp[nb] = compiled.memory_analysis().temp_size_in_bytes
    one_layer_growth = (1024 - 64) * cfg.num_kv_heads * 16 * cfg.head_dim * 4
    assert temp[1024] - temp[64] < one_layer_growth // 4, temp


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_step_temp_memory_does_not_grow_with_the_pool(backend):
    """A copy of the pool (or of one layer) would show up as temporary memory."""
    temp = {}
    for nb in (64, 1024):
        args = step_inputs(nb, decode_only=True)
        compiled = make_step(backend, True).trace(*args).lower().compile()
        temp[nb] = compiled.memory_analysis().temp_size_in_bytes
    one_layer_growth = (1024 - 64) * KVH * BS * D * 4
    assert temp[1024] - temp[64] < one_layer_growth // 4, temp


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_step_results_match_the_reference_backend(backend):
    for decode_only in (True, False):
        args = step_inputs(16, decode_only, seed=3)
        kv_ref, o_ref = make_step("reference", decode_only)(*step_inputs(16, decode_only, seed=3))
        kv, o = make_step(backend, decode_only)(*args)
        np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=2e-5)
        # Every block but the null one, which padding tokens all write into: on GPU the
        # scatter picks any of those duplicate writes, so its contents are unspecified.
        for got, want in ((kv.k, kv_ref.k), (kv.v, kv_ref.v)):
            np.testing.assert_array_equal(got[:, NULL_BLOCK + 1:], want[:, NULL_BLOCK + 1:])
