"""Attention backends chosen by the platform a step is lowered for (:mod:`jaxpaged.attention`).

No TPU or GPU here: steps are lowered for ``"tpu"`` and ``"cuda"`` from this CPU machine
(``.trace(...).lower(lowering_platforms=...)``), which runs the Mosaic and Triton
lowerings and shows which kernel each platform gets: a ``tpu_custom_call`` (Mosaic), a
``__gpu$xla.gpu.triton`` custom call (Triton), or neither (the XLA path). What this does
not prove: Mosaic's and Triton's later passes run only on the device. The TP case
(``tensor_parallel_size=3``) needs forced CPU devices and lives in ``tests/tp_cases.py``.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpaged.attention
import jaxpaged.runner
from jaxpaged import LLM, SamplingParams
from jaxpaged.attention import BACKENDS, AttentionMetadata, paged_attention, resolve_backend
from jaxpaged.cli import build_parser
from jaxpaged.compat import abstract_gpu
from jaxpaged.config import LlamaConfig
from jaxpaged.engine_args import DEFAULT_CPU_KV_MEMORY, EngineArgs, default_block_size, default_kv_bytes
from jaxpaged.kv_cache import KVPool
from jaxpaged.model import Llama
from jaxpaged.sampler import SamplingRow, build_sampling_metadata

MOSAIC = "tpu_custom_call"
TRITON = "__gpu$xla.gpu.triton"
i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)


def lower(fn, *args, platform: str, **kwargs) -> str:
    """StableHLO of ``fn`` (a jitted function) lowered for ``platform`` from this machine."""
    with abstract_gpu():  # jax 0.11 asks the (absent) GPU for its compute capability
        return fn.trace(*args, **kwargs).lower(lowering_platforms=(platform,)).as_text()


def kernels_in(hlo: str) -> set[str]:
    return {name for name, marker in (("mosaic", MOSAIC), ("triton", TRITON)) if marker in hlo}


EXPECTED = {"tpu": {"mosaic"}, "cuda": {"triton"}, "cpu": set()}


# ---- the rule -----------------------------------------------------------------------


def test_selection_table():
    table = {b: tuple(resolve_backend(b, p) for p in ("tpu", "cuda", "rocm", "cpu")) for b in BACKENDS}
    assert table == {
        "auto": ("pallas_tpu", "pallas_gpu", "pallas_gpu", "xla"),
        "pallas": ("pallas_tpu", "pallas_gpu", "pallas_gpu", "pallas_gpu"),
        "pallas_tpu": ("pallas_tpu", None, None, "pallas_tpu"),
        "pallas_gpu": (None, "pallas_gpu", "pallas_gpu", "pallas_gpu"),
        "xla": ("xla",) * 4,
        "reference": ("reference",) * 4,
    }
    with pytest.raises(ValueError, match=r"unknown attention backend 'tpu'; choose from \('auto', 'pallas', "
                                         r"'pallas_tpu', 'pallas_gpu', 'xla', 'reference'\)"):
        resolve_backend("tpu", "tpu")


def test_every_backend_is_an_engine_option_and_a_cli_choice():
    for b in BACKENDS:
        assert EngineArgs(attention_backend=b).attention_backend == b
        assert build_parser().parse_args(["hi", "--attention-backend", b]).attention_backend == b
    with pytest.raises(ValueError, match="unknown attention backend 'mosaic'"):
        EngineArgs(attention_backend="mosaic")


# ---- one attention call ---------------------------------------------------------------


def attention_args(decode: bool, *, block_size=16, head_dim=64, num_blocks=32, dtype=jnp.float32):
    """Abstract arguments of ``paged_attention``: 3 sequences, GQA group 3, 2 layers."""
    S, W = 3, 4
    T = S if decode else 24
    pool = jax.ShapeDtypeStruct((2, num_blocks, 2, block_size, head_dim), dtype)
    md = AttentionMetadata(positions=i32((T,)), slot_mapping=i32((T,)), block_tables=i32((S, W)),
                           context_lens=i32((S,)), query_start_loc=i32((S + 1,)), decode_only=decode)
    return jax.ShapeDtypeStruct((T, 6, head_dim), dtype), KVPool(pool, pool), i32(()), md


def attention_fn(backend: str):
    return jax.jit(functools.partial(paged_attention, scale=0.125, backend=backend))


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "ragged"])
@pytest.mark.parametrize("platform", ["tpu", "cuda", "cpu"])
@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_attention_lowers_to_the_platforms_kernel(backend, platform, decode):
    want = EXPECTED[platform]
    hlo = lower(attention_fn(backend), *attention_args(decode), platform=platform)
    if backend == "pallas" and platform == "cpu":
        want = set()  # the Triton kernels, interpreted: plain HLO
    assert kernels_in(hlo) == want
    if platform == "tpu":
        assert hlo.count(MOSAIC) == 1  # one kernel; the other platforms' branches are dropped


@pytest.mark.parametrize("backend,platform,kernel", [("pallas_tpu", "tpu", "mosaic"), ("pallas_gpu", "cuda", "triton")])
def test_named_backends_lower_for_their_platform(backend, platform, kernel):
    for decode in (True, False):
        assert kernels_in(lower(attention_fn(backend), *attention_args(decode), platform=platform)) == {kernel}


@pytest.mark.parametrize("backend,platform", [("pallas_tpu", "cuda"), ("pallas_gpu", "tpu")])
def test_named_backends_do_not_lower_elsewhere(backend, platform):
    with pytest.raises(NotImplementedError, match=f"platform_index.*not found for platform {platform}"):
        lower(attention_fn(backend), *attention_args(True), platform=platform)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "ragged"])
@pytest.mark.cpu_host
def test_auto_on_cpu_compiles_to_exactly_the_xla_path(decode):
    """The kernels' branches cost nothing at run time: the compiled CPU computation of
    ``"auto"`` holds the same instructions as ``"xla"``, so no conditional of its own (the
    XLA path's conditionals are its last-chunk pieces, ``pallas/xla.py``'s ``_chunk_plan``)."""
    def opcodes(backend):
        text = attention_fn(backend).trace(*attention_args(decode)).lower().compile().as_text()
        return text, sorted(re.findall(r"= \S+ ([\w-]+)\(", text))

    auto, auto_ops = opcodes("auto")
    _, xla_ops = opcodes("xla")
    assert auto_ops == xla_ops and len(xla_ops) > 100
    assert MOSAIC not in auto and "triton" not in auto


def test_auto_uses_xla_where_a_kernel_refuses_the_shapes():
    """block_size 4: not a whole sublane tile (Mosaic refuses); head_dim 8: under Triton's
    16-wide tiles. Under ``"auto"`` the refusing platform gets the XLA path."""
    args = attention_args(False, block_size=4)
    assert kernels_in(lower(attention_fn("auto"), *args, platform="tpu")) == set()
    assert kernels_in(lower(attention_fn("auto"), *args, platform="cuda")) == {"triton"}
    args = attention_args(True, head_dim=8)
    assert kernels_in(lower(attention_fn("auto"), *args, platform="tpu")) == {"mosaic"}
    assert kernels_in(lower(attention_fn("auto"), *args, platform="cuda")) == set()


@pytest.mark.cpu_host
def test_a_named_kernel_that_refuses_raises_its_own_error_here():
    """On this CPU process the interpreted kernel is the one that would run: its error."""
    with pytest.raises(ValueError, match=r"block_size=4 must be a multiple of 8 on TPU"):
        attention_fn("pallas_tpu").trace(*attention_args(True, block_size=4))
    # Triton refuses head_dim 8, but only on GPU: its interpreter runs it here, and the
    # step cannot be lowered for CUDA.
    args = attention_args(True, head_dim=8)
    assert kernels_in(attention_fn("pallas_gpu").trace(*args).lower().as_text()) == set()
    with pytest.raises(NotImplementedError, match="not found for platform cuda"):
        lower(attention_fn("pallas_gpu"), *args, platform="cuda")


# ---- the whole engine step ------------------------------------------------------------

TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=64)
BS, NB = 16, 32


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def step_args(decode: bool, *, backend="auto", cfg=TINY, dtype=jnp.float32):
    """Abstract arguments of the runner's forward for a tiny Llama: 3 sequences."""
    structure, params = jaxpaged.runner.split_model(Llama(cfg, dtype=dtype, attention_backend=backend,
                                                           rngs=nnx.Rngs(0)))
    pool = jax.ShapeDtypeStruct((cfg.num_layers, NB, cfg.num_kv_heads, BS, cfg.head_dim), dtype)
    q, _, _, md = attention_args(decode)
    T, S = q.shape[0], md.context_lens.shape[0]
    return structure, abstract(params), KVPool(pool, pool), i32((T,)), md, i32((S,))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "ragged"])
@pytest.mark.parametrize("platform", ["tpu", "cuda", "cpu"])
def test_model_step_lowers_to_the_platforms_kernel(platform, decode, dtype):
    hlo = lower(jaxpaged.runner.StepPrograms().forward, *step_args(decode, dtype=dtype), platform=platform)
    assert kernels_in(hlo) == EXPECTED[platform]
    assert hlo.count("tf.aliasing_output") == 2  # the donated pool's k and v, on every platform


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_model_step_with_lora_lowers_for_accelerators(platform):
    """A step holding LoRA requests (jaxpaged.lora: each token's slot, the slots' weights) lowers
    with the platform's attention kernel and the pool still donated."""
    from jaxpaged.lora import LoRAConfig, LoRASlots

    args = step_args(False)
    slots = LoRASlots(TINY, LoRAConfig(max_loras=2, max_lora_rank=8), jnp.float32, None)
    hlo = lower(jaxpaged.runner.StepPrograms().forward, *args, abstract(slots.weights), i32(args[3].shape),
                platform=platform)
    assert kernels_in(hlo) == EXPECTED[platform]
    assert hlo.count("tf.aliasing_output") == 2


def sampling_args(rows=4):
    """A batch of every sampling option: penalties, top-k / top-p / min-p, logprobs, seeds."""
    sp = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3),
          SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                         frequency_penalty=0.3, logprobs=2)]
    sampling_rows = [SamplingRow(p, i, [1, 2, 3], [4, 5]) for i, p in enumerate(sp)]
    sm, num_logprobs, use_penalties = build_sampling_metadata(sampling_rows, rows, TINY.vocab_size, (2,))
    assert num_logprobs and use_penalties
    logits = jax.ShapeDtypeStruct((rows + 3, TINY.vocab_size), jnp.float32)  # + 3 prompt-logprob rows
    return (logits, sm, np.zeros(3, np.int32)), dict(num_logprobs=num_logprobs, num_prompt_logprobs=2,
                                                     use_penalties=use_penalties)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sampler_and_block_moves_lower_for_accelerators(platform):
    """The rest of an engine step: sampling and the copy-on-write, swap-out and swap-in jits."""
    args, kwargs = sampling_args()
    hlo = lower(jaxpaged.runner.SamplerPrograms().sample, *args, platform=platform, **kwargs)
    assert "callback" not in hlo  # no host round trip in the step
    pool = jax.ShapeDtypeStruct((TINY.num_layers, NB, TINY.num_kv_heads, BS, TINY.head_dim), jnp.bfloat16)
    kv, ids = KVPool(pool, pool), i32((4,))
    blocks = jax.ShapeDtypeStruct((TINY.num_layers, 4, *pool.shape[2:]), jnp.bfloat16)
    moves = jaxpaged.runner.StepPrograms()
    for fn, fargs, donated in ((moves.copy, (kv, ids, ids), True), (moves.gather, (kv, ids), False),
                               (moves.scatter, (kv, ids, (blocks, blocks)), True)):
        hlo = lower(fn, *fargs, platform=platform)
        assert hlo.count("tf.aliasing_output") == (2 if donated else 0), fn


# ---- pallas_tpu on CPU, through the engine ------------------------------------------

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 41, 12], [200, 1, 2], list(range(30, 63))]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
ENGINE = dict(block_size=16, num_blocks=24, max_num_batched_tokens=32)  # chunked prefill: 33 > 32


@pytest.fixture(scope="module")
def xla_tokens(tiny_engine_model):
    outs = LLM(tiny_engine_model, attention_backend="xla", **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # not degenerate
    return tokens


@pytest.mark.cpu_host
def test_pallas_tpu_engine_on_cpu_gives_the_xla_tokens(tiny_engine_model, xla_tokens, monkeypatch):
    """The Mosaic kernels, in Pallas' interpreter, inside the engine's jitted steps (layer
    scan, donated pool, chunked prefill then decode): the same greedy tokens."""
    calls = _count_calls(monkeypatch, "tpu_paged_decode_attention", "tpu_ragged_paged_attention")
    llm = LLM(tiny_engine_model, attention_backend="pallas_tpu", **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == xla_tokens
    assert {"tpu_paged_decode_attention", "tpu_ragged_paged_attention"} <= set(calls)


def _count_calls(monkeypatch, *names) -> list[str]:
    """The names of ``jaxpaged.attention``'s kernels as they are called (traced), in order."""
    calls = []
    for name in names:
        monkeypatch.setattr(jaxpaged.attention, name,
                            functools.partial(_counted, getattr(jaxpaged.attention, name), calls, name))
    return calls


def _counted(kernel, calls, name, *args, **kwargs):
    calls.append(name)
    return kernel(*args, **kwargs)


@pytest.mark.cpu_host
def test_pallas_tpu_engine_in_tpu_interpret_mode(tiny_engine_model, xla_tokens):
    """The same under ``pltpu.force_tpu_interpret_mode()``: HBM, VMEM, SMEM, the DMAs and
    their semaphores simulated, uninitialised scratch filled with NaN."""
    from jax.experimental.pallas import tpu as pltpu

    llm = LLM(tiny_engine_model, attention_backend="pallas_tpu", **ENGINE)
    with pltpu.force_tpu_interpret_mode():
        outs = llm.generate(PROMPTS[:2], dataclasses.replace(GREEDY, max_tokens=3), use_tqdm=False)
        forward = jaxpaged.runner.StepPrograms().forward
        simulated = forward.trace(*step_args(True, backend="pallas_tpu")).lower().as_text()
    assert [o.outputs[0].token_ids for o in outs] == [t[:3] for t in xla_tokens[:2]]
    # TPU interpret mode runs through host callbacks; Pallas' plain interpreter has none.
    assert "callback" in simulated
    assert "callback" not in forward.trace(*step_args(True, backend="pallas_tpu")).lower().as_text()


@pytest.mark.cpu_host
def test_pallas_gpu_engine_with_every_mixed_step_switch_gives_the_xla_tokens(tiny_engine_model, xla_tokens,
                                                                              monkeypatch, fresh_traces):
    """The Triton kernels, interpreted, inside the engine's steps, with the mixed-step switches
    of ``pallas/ragged_paged_attention.py`` on (the engine's default path is the Pallas
    backend of ``test_engine_hf.py``). The second step holds two decode rows beside the last
    13 tokens of a chunked prompt: they go to the decode kernel."""
    from jaxpaged.pallas import ragged_paged_attention as gpu_ragged

    for name, value in (("MIXED_DECODE_ROWS", "split"), ("BLOCK_Q_RULE", "mean"), ("QUERY_LAYOUT", "direct")):
        monkeypatch.setattr(gpu_ragged, name, value)
    calls = _count_calls(monkeypatch, "paged_decode_attention", "ragged_paged_attention", "mixed_paged_attention")
    llm = LLM(tiny_engine_model, attention_backend="pallas_gpu", **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == xla_tokens
    assert {"paged_decode_attention", "mixed_paged_attention"} <= set(calls)
    assert "ragged_paged_attention" not in calls  # mixed_paged_attention calls the module's own


# ---- defaults on TPU ------------------------------------------------------------------


def test_default_kv_memory_is_half_the_free_device_memory_on_tpu_and_gpu():
    sizes = dict(block_bytes=1 << 20, block_size=16, max_num_seqs=256, max_model_len=8192)
    v5e = {"bytes_limit": 16 << 30, "bytes_in_use": 3 << 30, "peak_bytes_in_use": 4 << 30}
    for platform in ("tpu", "gpu"):
        assert default_kv_bytes(platform, v5e, **sizes) == (13 << 30) // 2
        assert default_kv_bytes(platform, None, **sizes) == DEFAULT_CPU_KV_MEMORY  # reports nothing
        assert default_kv_bytes(platform, {"bytes_limit": 1, "bytes_in_use": 2}, **sizes) == DEFAULT_CPU_KV_MEMORY
    # CPU: what the sequences can use, at most DEFAULT_CPU_KV_MEMORY, whatever the stats say.
    assert default_kv_bytes("cpu", v5e, **sizes) == DEFAULT_CPU_KV_MEMORY
    assert default_kv_bytes("cpu", None, **{**sizes, "max_num_seqs": 2, "max_model_len": 32}) == 2 * 3 << 20


def test_default_block_size_is_64_where_xla_attends_on_cpu(tiny_engine_model):
    assert default_block_size("cpu") == default_block_size("cpu", "xla") == 64
    for platform in ("gpu", "tpu"):
        assert default_block_size(platform) == default_block_size(platform, "xla") == 16
    assert default_block_size("cpu", "pallas_tpu") == default_block_size("cpu", "reference") == 16
    llm = LLM(tiny_engine_model, num_blocks=8)
    assert llm.block_size == llm.args.block_size == llm.bm.block_size == llm.runner.block_size == 64
    assert LLM(tiny_engine_model, num_blocks=8, block_size=8).bm.block_size == 8
    assert LLM(tiny_engine_model, num_blocks=8, attention_backend="pallas_tpu").runner.block_size == 16
    assert build_parser().parse_args([]).block_size is None  # the CLI leaves it to the engine


def test_engine_args_size_the_pool_from_the_devices_memory(monkeypatch):
    class FakeTPU:
        platform = "tpu"

        def memory_stats(self):
            return {"bytes_limit": 16 << 30, "bytes_in_use": 4 << 30}

    monkeypatch.setattr(jax, "local_devices", lambda: [FakeTPU()])
    assert EngineArgs(tensor_parallel_size=2).kv_blocks(block_bytes=2 << 20, max_model_len=4096) == 6 << 10


@pytest.mark.cpu_host
def test_default_dtype_is_bfloat16_on_tpu(tmp_path, monkeypatch):
    from conftest import make_tiny_tp_hf

    from jaxpaged.loader import load_model

    folder = make_tiny_tp_hf(tmp_path)
    assert load_model(folder).model.dtype == jnp.float32  # this CPU machine
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert load_model(folder).model.dtype == jnp.bfloat16
