"""The stacked-weight matmul (pallas/stacked_matmul.py) against x @ w[layer], and its Triton lowering."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.compat import abstract_gpu
from jaxpaged.pallas.stacked_matmul import (TARGET_PROGRAMS, WAVE_PROGRAMS, default_config, default_splits,
                                            default_tokens_fastest, grouped_stacked_matmul, stacked_matmul, supports)


def case(seed, T, K, N, L=3, dtype=jnp.float32):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (T, K), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (L, K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
    return x, w


@pytest.mark.parametrize("T, K, N, blocks", [
    (5, 64, 48, (16, 16, 16)),  # T padded to a token tile; several n and k tiles
    (33, 96, 64, (16, 32, 32)),  # T over two tiles, the last partial
    (64, 576, 192, None),  # SmolLM2's hidden -> KV width, default tiles (n 64, k 64)
    (16, 128, 256, (16, 128, 64)),
])
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("tokens_fastest", [False, True], ids=["columns-fastest", "tokens-fastest"])
def test_matches_the_layer_matmul_float32(T, K, N, blocks, layer, tokens_fastest):
    x, w = case(T * 7 + layer, T, K, N)
    got = stacked_matmul(x, w, jnp.int32(layer), blocks=blocks, interpret=True, tokens_fastest=tokens_fastest)
    want = jnp.einsum("TK,KN->TN", x, w[layer], precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (T, N) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T, K, N, blocks, splits", [
    (5, 256, 48, (16, 16, 32), 2),  # two halves of K, partials summed
    (33, 512, 64, (16, 32, 64), 4),  # T over two tiles; four quarters of K
    (16, 1024, 256, (16, 64, 128), 8),
])
@pytest.mark.parametrize("tokens_fastest", [False, True], ids=["columns-fastest", "tokens-fastest"])
def test_split_k_matches_the_layer_matmul(T, K, N, blocks, splits, tokens_fastest):
    x, w = case(T + splits, T, K, N)
    got = stacked_matmul(x, w, jnp.int32(2), blocks=blocks, splits=splits, interpret=True,
                         tokens_fastest=tokens_fastest)
    want = jnp.einsum("TK,KN->TN", x, w[2], precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (T, N) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=f"splits=3 x block_k={blocks[2]} does not divide K={K}"):
        stacked_matmul(x, w, 0, blocks=blocks, splits=3, interpret=True)


@pytest.mark.parametrize("T, widths, blocks, splits", [
    (20, (64, 32, 32), (16, 32, 16), 1),  # q, k, v-like: one launch, each tile from its own stack
    (7, (48, 48), None, 1),  # gate, up-like, default tiles
    (16, (128, 64, 64), (16, 32, 32), 2),  # with split-K partials
    (40, (64, 32, 32), (16, 32, 16), 2),  # three token tiles, split-K partials
])
@pytest.mark.parametrize("tokens_fastest", [False, True], ids=["columns-fastest", "tokens-fastest"])
def test_grouped_matches_each_layer_matmul(T, widths, blocks, splits, tokens_fastest):
    K = 64
    x, _ = case(T, T, K, 1)
    ws = [case(T + i + 1, 1, K, n)[1] for i, n in enumerate(widths)]
    got = grouped_stacked_matmul(x, tuple(ws), jnp.int32(1), blocks=blocks, splits=splits, interpret=True,
                                 tokens_fastest=tokens_fastest)
    assert len(got) == len(widths)
    for g, w in zip(got, ws):
        want = jnp.einsum("TK,KN->TN", x, w[1], precision=jax.lax.Precision.HIGHEST)
        assert g.shape == want.shape and g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"must be \[T, K\] and \[L, K, N\] with one L and K"):
        grouped_stacked_matmul(x, (ws[0], ws[1][:, :32]), 0)
    with pytest.raises(ValueError, match="block_n=64 does not divide 48"):
        grouped_stacked_matmul(x, (ws[0], case(0, 1, K, 48)[1]), 0, blocks=(16, 64, 16), interpret=True)


def test_matches_the_layer_matmul_bfloat16_and_traced_layer():
    x, w = case(1, 24, 128, 128, L=4, dtype=jnp.bfloat16)
    f = jax.jit(functools.partial(stacked_matmul, blocks=(16, 64, 32), interpret=True))
    for layer in (3, 1):
        got = f(x, w, jnp.int32(layer)).astype(jnp.float32)
        want = jnp.einsum("TK,KN->TN", x.astype(jnp.float32), w[layer].astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-2, rtol=2e-2)


def test_default_config_tiles_are_powers_of_two_that_divide():
    assert default_config(256, 4096, 14336) == ((128, 128, 64), 8, 3)  # Llama-3-8B gate alone: 224 programs
    assert default_config(256, 4096, 28672) == ((128, 256, 64), 8, 3)  # gate/up grouped
    assert default_config(256, 14336, 4096) == ((128, 64, 128), 8, 4)  # down: 128 programs only 64 wide
    assert default_config(512, 14336, 4096) == ((128, 128, 128), 8, 3)
    assert default_config(1024, 14336, 4096) == ((128, 256, 64), 8, 3)
    assert default_config(64, 4096, 14336) == ((64, 64, 128), 4, 3)
    assert default_config(3, 576, 192) == ((16, 64, 64), 4, 3)  # SmolLM2: K = 576 = 9 x 64
    assert default_config(32, 1536, 576) == ((32, 64, 128), 4, 3)
    for T in (65, 128, 200, 256, 512, 720, 1024):
        for K, N in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (576, 192), (576, 3072)):
            (bt, bn, bk), warps, stages = default_config(T, K, N)
            assert all(b >= 16 and b & (b - 1) == 0 for b in (bt, bn, bk)) and N % bn == 0 and K % bk == 0
            assert bt == 128 and warps == 8
            # widest tiles that keep about a wave of programs, down to 64 wide
            assert bn == 64 or (N // bn) * -(-T // bt) >= WAVE_PROGRAMS, (T, K, N, bn)


def test_token_tiles_launch_first_when_there_are_several():
    assert not default_tokens_fastest(128, 4096, 28672, (128, 256, 64))
    assert not default_tokens_fastest(16, 4096, 4096, (16, 64, 128))
    assert default_tokens_fastest(129, 4096, 28672, (128, 256, 64))
    assert default_tokens_fastest(1024, 14336, 4096, (128, 256, 64))


def test_default_splits_fill_the_gpu_for_few_tokens_and_narrow_outputs():
    # Llama-3-8B at 16 tokens: q/o, k/v, gate/up, down
    got = {name: default_splits(16, K, N, default_config(16, K, N)[0])
           for name, K, N in (("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate/up", 4096, 14336),
                              ("down", 14336, 4096))}
    assert got == {"q/o": 4, "k/v": 8, "gate/up": 1, "down": 4}
    for T in (1, 16, 64, 128, 256, 512, 1024):
        for K, N in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (576, 192), (1536, 576)):
            blocks = default_config(T, K, N)[0]
            bt, bn, bk = blocks
            s = default_splits(T, K, N, blocks)
            programs = (N // bn) * -(-T // bt)
            assert s & (s - 1) == 0 and K % (s * bk) == 0, (T, K, N, s)
            if s > 1:  # each split earns its place: the GPU was short of programs, the partials stay small
                assert programs * s <= TARGET_PROGRAMS and K // (s * bk) >= 4 and 8 * s * T <= K, (T, K, N, s)
    assert default_splits(128, 4096, 1024, default_config(128, 4096, 1024)[0]) == 1  # decode-sized steps only


def test_bad_shapes_and_tiles_are_explained():
    x, w = case(0, 8, 64, 48)
    with pytest.raises(ValueError, match=r"x \(8, 32\) and w \(3, 64, 48\) must be \[T, K\] and \[L, K, N\]"):
        stacked_matmul(x[:, :32], w, 0)
    with pytest.raises(ValueError, match="block_n=32 does not divide 48"):
        stacked_matmul(x, w, 0, blocks=(16, 32, 16), interpret=True)
    with pytest.raises(ValueError, match="x is bfloat16, w is float32"):
        stacked_matmul(x.astype(jnp.bfloat16), w, 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton(dtype):
    x, w = case(0, 256, 4096, 1024, L=2, dtype=dtype)
    f = functools.partial(stacked_matmul, interpret=False)
    with abstract_gpu():
        text = jax.jit(f).trace(x, w, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "stacked_matmul_t128_n64_k128_tf" in text  # two token tiles
    with abstract_gpu():  # split-K: one kernel writing float32 partials, summed by XLA
        f = functools.partial(stacked_matmul, blocks=(16, 64, 128), splits=4, interpret=False)
        text = jax.jit(f).trace(x[:16], w, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "stacked_matmul_t16_n64_k128_s4" in text and "stablehlo.reduce" in text
    with abstract_gpu():  # by default on a GPU, k/v at 16 tokens split K in 8
        f = functools.partial(stacked_matmul, interpret=False)
        text = jax.jit(f).trace(x[:16], w, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "stacked_matmul_t16_n64_k128_s8" in text
    with abstract_gpu():  # q, k, v of Llama-3-8B at 16 tokens: one launch of 96 tiles, split in 2
        wq = case(1, 1, 4096, 4096, L=2, dtype=dtype)[1]
        f = functools.partial(grouped_stacked_matmul, interpret=False)
        text = jax.jit(f).trace(x[:16], (wq, w, w), jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "stacked_matmul_t16_n64_k128_g3_s2" in text
    with abstract_gpu():  # the token tiles of a column side by side, grouped, split: a grid Triton accepts
        f = functools.partial(grouped_stacked_matmul, blocks=(64, 64, 128), splits=2, tokens_fastest=True,
                              interpret=False)
        text = jax.jit(f).trace(x, (wq, w, w), jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "stacked_matmul_t64_n64_k128_g3_s2_tf" in text


def test_supports_only_shapes_triton_can_tile():
    assert supports(4096, 14336) and supports(576, 192) and supports(96, 128)
    assert not supports(100, 128) and not supports(64, 8) and not supports(24, 64)


def _model_step(cfg, kv, tokens, md, logits_indices):
    """The model's step lowered for CUDA (StableHLO text) and run here (logits)."""
    from flax import nnx

    from jaxpaged import runner
    from jaxpaged.model import Llama

    args = (*runner.split_model(Llama(cfg, attention_backend="auto", rngs=nnx.Rngs(0))), kv, tokens, md,
            logits_indices)
    with abstract_gpu():
        cuda = runner.StepPrograms().forward.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return cuda, args


def _call_sites(cuda: str) -> int:
    return len(re.findall(r"call @_stacked_matmul", cuda))


def test_model_with_an_untileable_mlp_still_lowers_for_cuda_and_runs_here():
    """Decode steps lowered for CUDA read all seven projections with the kernel where it can
    tile them, in four launches (q/k/v, o, gate/up, down); an odd MLP width keeps XLA's
    matmul for the MLP on every platform instead of failing to trace, and the attention
    projections keep the kernel."""
    from jaxpaged import runner
    from jaxpaged.attention import AttentionMetadata
    from jaxpaged.config import LlamaConfig
    from jaxpaged.kv_cache import init_kv_pool

    def decode_step(intermediate):
        cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=intermediate, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)
        md = AttentionMetadata(positions=jnp.array([3, 0]), slot_mapping=jnp.array([19, 0]),
                               block_tables=jnp.array([[1, 0, 0, 0], [0, 0, 0, 0]]), context_lens=jnp.array([4, 0]),
                               query_start_loc=jnp.array([0, 1, 1]), decode_only=True)
        cuda, args = _model_step(cfg, init_kv_pool(2, 9, 2, 16, 16, jnp.float32), jnp.array([5, 0]), md,
                                 jnp.array([0, 1]))
        logits, _ = runner.StepPrograms().forward(*args)
        assert bool(jnp.all(jnp.isfinite(logits)))
        return cuda

    assert _call_sites(decode_step(128)) == 4
    assert _call_sites(decode_step(100)) == 2


@pytest.mark.parametrize("extra, sites", [(0, 4), (16, 0)], ids=["at-the-bound", "past-it"])
def test_mixed_steps_up_to_the_token_bound_read_the_weights_in_place(extra, sites):
    """Steps of at most ``STACKED_MAX_TOKENS`` tokens (continuous batching's decode + prefill
    chunks) take the kernel for all seven projections (four launches) when lowered for CUDA; bigger prefill
    steps keep XLA's matmul."""
    from jaxpaged.attention import AttentionMetadata
    from jaxpaged.config import LlamaConfig
    from jaxpaged.kv_cache import init_kv_pool
    from jaxpaged.model import STACKED_MAX_TOKENS

    T, BS = STACKED_MAX_TOKENS + extra, 16
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2 * T)
    nblocks = T // BS
    md = AttentionMetadata(positions=jnp.arange(T), slot_mapping=BS + jnp.arange(T),
                           block_tables=1 + jnp.arange(nblocks)[None], context_lens=jnp.array([T]),
                           query_start_loc=jnp.array([0, T]), decode_only=False)
    cuda, _ = _model_step(cfg, init_kv_pool(2, nblocks + 1, 2, BS, 16, jnp.float32), jnp.zeros(T, jnp.int32), md,
                          jnp.array([T - 1]))
    assert _call_sites(cuda) == sites



# ---- the Mosaic GPU kernel (pallas/stacked_matmul_mgpu.py) ------------------------------

def small_mosaic():
    """Small tiles, so that Mosaic GPU's interpreter (it simulates every program's TMA
    copies, barriers and wgmma) stays quick: 64 tokens x 128 columns a program, 64 deep."""
    from jaxpaged.pallas.stacked_matmul_mgpu import MosaicMatmulConfig

    return MosaicMatmulConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, epi_m=64, epi_n=64)


@pytest.mark.parametrize("T, K, widths, layer, small", [
    (100, 192, (256, 128, 128), 1, True),  # q/k/v-like: three stacks, tokens padded to two token tiles
    (64, 128, (128,), 2, True),  # one stack, one tile of each
    (130, 64, (128, 128), 0, True),  # gate/up-like, three token tiles
    (100, 128, (256, 256), 1, False),  # the tiles default_config picks (128 x 256, 4 stages)
])
def test_mosaic_matches_each_layer_matmul_in_the_interpreter(T, K, widths, layer, small):
    from jaxpaged.pallas.stacked_matmul_mgpu import mosaic_grouped_stacked_matmul

    kx, kw = jax.random.split(jax.random.key(T + K + layer))
    x = jax.random.normal(kx, (T, K), jnp.float32).astype(jnp.bfloat16)
    ws = tuple((jax.random.normal(k, (3, K, n), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
               for k, n in zip(jax.random.split(kw, len(widths)), widths))
    got = mosaic_grouped_stacked_matmul(x, ws, jnp.int32(layer), config=small_mosaic() if small else None,
                                        interpret=True)
    assert len(got) == len(widths)
    for out, w in zip(got, ws):
        want = jnp.einsum("TK,KN->TN", x.astype(jnp.float32), w[layer].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        other = jnp.einsum("TK,KN->TN", x.astype(jnp.float32), w[(layer + 1) % 3].astype(jnp.float32))
        assert out.shape == (T, w.shape[2]) and out.dtype == jnp.bfloat16
        # float32 sums of bf16 products, rounded to bf16 once (|want| < ~5: 2^-8 relative)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3e-2, rtol=1e-2)
        assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - other))) > 0.5  # the layer's own weights


def test_mosaic_refuses_what_it_cannot_tile_and_names_it():
    from jaxpaged.pallas.stacked_matmul_mgpu import mosaic_grouped_stacked_matmul
    from jaxpaged.pallas.stacked_matmul_mgpu import supports as mosaic_supports

    assert mosaic_supports(4096, (4096, 1024, 1024), jnp.bfloat16) and mosaic_supports(14336, (4096,), jnp.float16)
    assert not mosaic_supports(4096, (4096,), jnp.float32)  # wgmma has no IEEE float32
    assert not mosaic_supports(576, (576,), jnp.bfloat16)  # SmolLM2's widths: not multiples of 256
    assert not mosaic_supports(4100, (4096,), jnp.bfloat16)
    x = jnp.zeros((8, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"K=576 and widths \(192,\) in bfloat16 do not fit"):
        mosaic_grouped_stacked_matmul(x, (jnp.zeros((2, 576, 192), jnp.bfloat16),), 0)
    with pytest.raises(ValueError, match="expected one dtype"):
        mosaic_grouped_stacked_matmul(x, (jnp.zeros((2, 576, 256), jnp.float32),), 0)


def test_mosaic_tiles_shrink_until_every_multiprocessor_has_one():
    from jaxpaged.pallas.stacked_matmul_mgpu import (DEFAULT_CONFIG, MosaicMatmulConfig, check_config,
                                                     default_config)

    assert default_config(1024, 4096, (14336, 14336), 132) == DEFAULT_CONFIG  # gate/up: 8 x 112 tiles
    c = default_config(512, 4096, (4096, 1024, 1024), 132)  # q/k/v: 4 x 24 tiles of 128 x 256
    assert (c.tile_m, c.tile_n) == (128, 64)  # 4 x 48
    c = default_config(256, 14336, (4096,), 132)  # down: no tile reaches 132; the most tiles
    assert (c.tile_m, c.tile_n) == (64, 64)  # 4 x 32
    assert default_config(256, 4096, (384,), 132).tile_n == 64  # only the narrow tile divides 384
    for bad in (MosaicMatmulConfig(tile_m=96), MosaicMatmulConfig(epi_m=128, tile_m=64),
                MosaicMatmulConfig(max_concurrent_steps=0)):
        with pytest.raises(ValueError, match="does not fit"):
            check_config(bad)


def test_mosaic_lowers_for_cuda_at_llama_3_8b_shapes():
    """The default tiles (128 x 256 a program, 4 stages) lower to one Mosaic GPU kernel for
    Llama-3-8B's grouped q/k/v and its down projection, with the layer traced."""
    from jaxpaged.pallas.stacked_matmul_mgpu import mosaic_grouped_stacked_matmul

    S = jax.ShapeDtypeStruct
    for T, K, widths in ((512, 4096, (4096, 1024, 1024)), (300, 14336, (4096,))):
        ws = tuple(S((32, K, n), jnp.bfloat16) for n in widths)
        with abstract_gpu():
            text = jax.jit(lambda x, ws, layer: mosaic_grouped_stacked_matmul(x, ws, layer)).trace(
                S((T, K), jnp.bfloat16), ws, S((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
        assert "__gpu$xla.gpu.triton" not in text


def test_model_steps_past_decode_size_take_the_mosaic_kernel_when_asked(monkeypatch):
    """With ``STACKED_KERNEL = "mosaic"``, a 128-token step of a model whose widths fit (all
    multiples of 256, bf16) lowers its four projection launches per layer to Mosaic GPU;
    a 16-token step keeps the Triton kernel; the CPU run is unchanged."""
    from jaxpaged import model as model_mod
    from jaxpaged.attention import AttentionMetadata
    from jaxpaged.config import LlamaConfig
    from jaxpaged.kv_cache import init_kv_pool

    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=4, head_dim=64, max_position_embeddings=512)

    def lowered(T):
        md = AttentionMetadata(positions=jnp.arange(T), slot_mapping=16 + jnp.arange(T),
                               block_tables=1 + jnp.arange(T // 16)[None], context_lens=jnp.array([T]),
                               query_start_loc=jnp.array([0, T]), decode_only=False)
        from flax import nnx

        from jaxpaged import runner
        from jaxpaged.model import Llama

        llama = Llama(cfg, attention_backend="auto", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        args = (*runner.split_model(llama), init_kv_pool(2, T // 16 + 1, 4, 16, 64, jnp.bfloat16),
                jnp.ones(T, jnp.int32), md, jnp.array([T - 1]))
        with abstract_gpu():
            return runner.StepPrograms().forward.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    monkeypatch.setattr(model_mod, "STACKED_KERNEL", "mosaic")
    assert len(re.findall(r"custom_call @mosaic_gpu", lowered(128))) == 4  # q/k/v, o, gate/up, down
    assert len(re.findall(r"custom_call @mosaic_gpu", lowered(16))) == 0
    monkeypatch.setattr(model_mod, "STACKED_KERNEL", "auto")  # widths of at most 1,024: Triton below 2,048 tokens
    assert len(re.findall(r"custom_call @mosaic_gpu", lowered(160))) == 0
    monkeypatch.setattr(model_mod, "STACKED_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="STACKED_KERNEL='cutlass'"):
        lowered(144)  # a shape not traced yet: the setting is read when a step is traced


def test_auto_stacked_kernel_takes_mosaic_for_wide_stacks_and_long_steps(monkeypatch):
    """``STACKED_KERNEL = "auto"``: Mosaic for gate/up-wide launches and 2,048-token steps
    (where an H100 measured it faster), Triton for the rest and for decode-sized steps."""
    from jaxpaged import model as model_mod

    monkeypatch.setattr(model_mod, "STACKED_KERNEL", "auto")
    pick = model_mod.stacked_kernel_for
    qkv, o, gate_up = (4096, 1024, 1024), (4096,), (14336, 14336)
    assert [pick(T, qkv) for T in (16, 256, 1024, 2048)] == ["triton", "triton", "triton", "mosaic"]
    assert [pick(T, o) for T in (256, 1024, 2048)] == ["triton", "triton", "mosaic"]
    assert [pick(T, gate_up) for T in (64, 128, 256, 1024)] == ["triton", "mosaic", "mosaic", "mosaic"]
    monkeypatch.setattr(model_mod, "STACKED_KERNEL", "mosaic")
    assert pick(256, qkv) == "mosaic" and pick(64, gate_up) == "triton"
    monkeypatch.setattr(model_mod, "STACKED_KERNEL", "triton")
    assert pick(2048, gate_up) == "triton"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Mosaic GPU kernel needs a Hopper GPU")
@pytest.mark.parametrize("T, K, widths", [(512, 4096, (4096, 1024, 1024)), (200, 14336, (4096,)),
                                          (1000, 4096, (14336, 14336))])
def test_mosaic_native_matches_xla_at_llama_3_8b_shapes(T, K, widths):
    from jaxpaged.pallas.stacked_matmul_mgpu import mosaic_grouped_stacked_matmul

    kx, kw = jax.random.split(jax.random.key(T))
    x = jax.random.normal(kx, (T, K), jnp.float32).astype(jnp.bfloat16)
    ws = tuple((jax.random.normal(k, (2, K, n), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
               for k, n in zip(jax.random.split(kw, len(widths)), widths))
    got = mosaic_grouped_stacked_matmul(x, ws, jnp.int32(1))
    for out, w in zip(got, ws):
        want = jnp.dot(x, w[1], preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3e-2, rtol=1e-2)
