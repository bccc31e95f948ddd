"""The reference paged attention on tiny cases computed by hand.

Keys are chosen so the softmax weights are simple fractions: with ``q = [1, 0]``,
``scale = 1`` and keys ``[0, 0], [ln 2, 0], [ln 3, 0]`` the logits are ``0, ln 2, ln 3``
and the weights ``1/6, 2/6, 3/6``.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.attention import AttentionMetadata, paged_attention
from jaxpaged.kv_cache import KVPool
from jaxpaged.pallas.reference import ref_paged_decode_attention, ref_ragged_paged_attention

NAN = float("nan")
# A 3-token sequence in blocks of 2: logical block 0 -> physical 3, logical block 1 -> 1.
TABLE = [3, 1]
KEYS = [[0.0, 0.0], [math.log(2), 0.0], [math.log(3), 0.0]]
VALUES = [[6.0, 0.0], [0.0, 6.0], [0.0, 0.0]]


def one_head_pool(num_layers=1, num_blocks=4):
    """Pool [L, NB, 1, 2, 2] holding the sequence in every layer; everything else NaN."""
    k = np.full((num_layers, num_blocks, 1, 2, 2), NAN, np.float32)
    v = np.full_like(k, NAN)
    for pos in range(3):
        blk, off = TABLE[pos // 2], pos % 2
        k[:, blk, 0, off] = KEYS[pos]
        v[:, blk, 0, off] = VALUES[pos]
    return k, v


def i32(x):
    return jnp.asarray(x, jnp.int32)


def test_decode_weights_are_exp_of_logits():
    k, v = one_head_pool()
    q = jnp.asarray([[[1.0, 0.0]]])  # [S=1, Hq=1, D=2]
    o = ref_paged_decode_attention(q, k, v, 0, i32([TABLE]), i32([3]), scale=1.0)
    # 1/6 * [6, 0] + 2/6 * [0, 6] + 3/6 * [0, 0]
    np.testing.assert_allclose(o[0, 0], [1.0, 2.0], rtol=1e-6)


def test_scale_multiplies_logits():
    k, v = one_head_pool()
    q = jnp.asarray([[[2.0, 0.0]]])  # scale 0.5 undoes the 2
    o = ref_paged_decode_attention(q, k, v, 0, i32([TABLE]), i32([3]), scale=0.5)
    np.testing.assert_allclose(o[0, 0], [1.0, 2.0], rtol=1e-6)


def test_shorter_context_ignores_later_slots():
    k, v = one_head_pool()
    q = jnp.asarray([[[1.0, 0.0]]])
    o = ref_paged_decode_attention(q, k, v, 0, i32([TABLE]), i32([2]), scale=1.0)
    # weights 1/3, 2/3 over the first two keys; slot 2 is never read (NaN elsewhere)
    np.testing.assert_allclose(o[0, 0], [2.0, 4.0], rtol=1e-6)


def test_prefill_is_causal():
    k, v = one_head_pool()
    q = jnp.ones((3, 1, 2)) * jnp.asarray([1.0, 0.0])
    o = ref_ragged_paged_attention(q, k, v, 0, i32([TABLE]), i32([3]), i32([0, 3]), i32([0, 1, 2]),
                                   scale=1.0)
    np.testing.assert_allclose(o[:, 0], [[6.0, 0.0], [2.0, 4.0], [1.0, 2.0]], rtol=1e-6)


def test_chunk_after_cached_prefix_starts_at_its_position():
    k, v = one_head_pool()
    q = jnp.ones((2, 1, 2)) * jnp.asarray([1.0, 0.0])  # tokens 1 and 2; token 0 is cached
    o = ref_ragged_paged_attention(q, k, v, 0, i32([TABLE]), i32([3]), i32([0, 2]), i32([1, 2]),
                                   scale=1.0)
    np.testing.assert_allclose(o[:, 0], [[2.0, 4.0], [1.0, 2.0]], rtol=1e-6)


def test_gqa_query_heads_share_their_kv_head():
    # 4 query heads, 2 KV heads: heads 0, 1 read KV head 0; heads 2, 3 read KV head 1.
    k1, v1 = one_head_pool()
    k = np.concatenate([k1, np.zeros_like(k1)], axis=2)  # [1, 4, 2, 2, 2]
    v = np.concatenate([v1, np.full_like(v1, 7.0)], axis=2)
    k[:, :, 1][np.isnan(k1[:, :, 0])] = NAN
    q = jnp.asarray([[[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [5.0, 5.0]]])
    o = ref_paged_decode_attention(q, k, v, 0, i32([TABLE]), i32([3]), scale=1.0)
    np.testing.assert_allclose(o[0, 0], [1.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(o[0, 1], [2.0, 2.0], rtol=1e-6)  # q = 0: plain mean of the values
    np.testing.assert_allclose(o[0, 2:], [[7.0, 7.0], [7.0, 7.0]], rtol=1e-6)


def test_layer_selects_its_slice_of_the_pool():
    k, v = one_head_pool(num_layers=2)
    v[0] = NAN  # layer 0 is never read
    v[1] *= 2
    q = jnp.asarray([[[1.0, 0.0]]])
    o = ref_paged_decode_attention(q, k, v, i32(1), i32([TABLE]), i32([3]), scale=1.0)
    np.testing.assert_allclose(o[0, 0], [2.0, 4.0], rtol=1e-6)


def test_padding_rows_and_tokens_give_zeros():
    k, v = one_head_pool()
    q = jnp.ones((4, 1, 2))
    # sequence 0: 1 token (decode at position 2); sequence 1: padding; tokens 1..3: padding
    o = ref_ragged_paged_attention(q, k, v, 0, i32([TABLE, [0, 0]]), i32([3, 0]), i32([0, 1, 1]),
                                   i32([2, 0, 0, 0]), scale=1.0)
    assert np.all(np.isfinite(o))
    np.testing.assert_array_equal(o[1:], 0.0)
    o = ref_paged_decode_attention(q[:2], k, v, 0, i32([TABLE, [0, 0]]), i32([3, 0]), scale=1.0)
    np.testing.assert_array_equal(o[1], 0.0)


def test_bf16_in_bf16_out_float32_softmax():
    k, v = one_head_pool()
    q = jnp.asarray([[[1.0, 0.0]]], jnp.bfloat16)
    o = ref_paged_decode_attention(q, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), 0,
                                   i32([TABLE]), i32([3]), scale=1.0)
    assert o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o[0, 0], np.float32), [1.0, 2.0], rtol=1e-2)


@pytest.mark.parametrize("decode_only", [False, True])
def test_paged_attention_entry_point_uses_the_metadata(decode_only):
    k, v = one_head_pool(num_layers=2)
    kv = KVPool(jnp.asarray(k), jnp.asarray(v))
    md = AttentionMetadata(positions=i32([2, 0]), slot_mapping=i32([3, 0]),
                           block_tables=i32([TABLE, [0, 0]]), context_lens=i32([3, 0]),
                           query_start_loc=i32([0, 1, 1]), decode_only=decode_only)
    q = jnp.asarray([[[1.0, 0.0]], [[1.0, 0.0]]])
    o = paged_attention(q, kv, i32(1), md, scale=1.0, backend="reference")
    np.testing.assert_allclose(o[0, 0], [1.0, 2.0], rtol=1e-6)
    np.testing.assert_array_equal(o[1], 0.0)


def test_unknown_backend_is_named():
    k, v = one_head_pool()
    md = AttentionMetadata(positions=i32([2]), slot_mapping=i32([3]), block_tables=i32([TABLE]),
                           context_lens=i32([3]), query_start_loc=i32([0, 1]))
    with pytest.raises(ValueError, match="'cuda'"):
        paged_attention(jnp.ones((1, 1, 2)), KVPool(k, v), i32(0), md, scale=1.0, backend="cuda")
