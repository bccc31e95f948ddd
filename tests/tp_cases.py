"""Tensor parallelism on 4 simulated CPU devices: the same tokens and logits as one device,
the expected collectives in the compiled step, every array split 1/N.

Needs 4 devices before jax starts, so ``tests/test_tp.py`` runs this module in its own process:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m pytest tests/tp_cases.py
"""

import os
import re

import jax
import numpy as np
import pytest
from conftest import make_tiny_tp_hf
from flax import nnx
from paged import jit_forward, step_metadata
from safetensors.numpy import load_file

import jaxpaged.runner
from jaxpaged import LLM, SamplingParams, sharding
from jaxpaged.cli import main as cli_main
from jaxpaged.config import LlamaConfig
from jaxpaged.kv_cache import KVPool, init_kv_pool
from jaxpaged.loader import load_model, shard_model
from jaxpaged.model import Llama

pytestmark = pytest.mark.skipif(jax.device_count() < 4,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=4")

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 41, 12], [200, 1, 2], list(range(30, 63)), [64] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
BS = 4
ENGINE = dict(block_size=16, num_blocks=64, max_num_batched_tokens=16)  # chunked prefill: 33 > 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The 8-head / 4-KV-head model: built by the parent test (no torch import here) or now."""
    folder = os.environ.get("JAXPAGED_TP_TINY")
    return folder or make_tiny_tp_hf(tmp_path_factory.mktemp("tiny-tp"))


@pytest.fixture(scope="module")
def engines(tiny):
    """For tp = 1, 2, 4: the engine after two passes over PROMPTS (the second hits the prefix
    cache), both passes' outputs, and the abstract arguments of its first prefill and first
    decode step (for the HLO)."""
    out = {}
    for tp in (1, 2, 4):
        llm = LLM(tiny, tensor_parallel_size=tp, **ENGINE)
        recording = _Recording(llm.runner.programs)
        with pytest.MonkeyPatch.context() as mp:  # this engine's programs only, while it runs
            mp.setattr(llm.runner, "programs", recording)
            passes = [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for _ in range(2)]
        out[tp] = llm, passes, recording.calls
    return out


class _Recording:
    """A runner's programs, recording the abstract arguments of its first prefill and decode step."""

    def __init__(self, programs):
        self.programs, self.calls = programs, {}

    def __getattr__(self, name):
        return getattr(self.programs, name)

    def forward(self, *args, **kwargs):
        self.calls.setdefault(args[4].decode_only, (jax.tree.map(_abstract, args), kwargs))
        return self.programs.forward(*args, **kwargs)


def _abstract(x, mesh=None):
    """An array's shape, dtype and sharding (re-expressed on ``mesh`` when given)."""
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if mesh is None else
                                jax.sharding.NamedSharding(mesh, x.sharding.spec))


def assert_same_outputs(outs, ref):
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for step, (a, b) in enumerate(zip(o.outputs[0].logprobs, r.outputs[0].logprobs)):
            assert a.keys() == b.keys(), step
            np.testing.assert_allclose([a[t].logprob for t in a], [b[t].logprob for t in a], atol=1e-4, rtol=0)


def greedy_logits(model, steps=4):
    """A padded ragged prefill of 3 sequences, then ``steps`` greedy decode steps, straight
    through the model: (the sequences' prompts, their greedy tokens, the logits of each step)."""
    mesh, cfg = model.mesh, model.cfg
    kv = init_kv_pool(cfg.num_layers, 1 + 3 * 8, cfg.num_kv_heads, BS, cfg.head_dim, model.dtype,
                      device=None if mesh is None else sharding.pool_sharding(mesh))
    fwd = jit_forward(model)
    lens = [7, 13, 2]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, sum(lens) + 3).astype(np.int32)
    prompts = np.split(tokens[:sum(lens)], np.cumsum(lens)[:-1])
    md = step_metadata([0] * 3, lens, block_size=BS, blocks_per_seq=8, pad_tokens=3, pad_seqs=1)
    real = np.arange(sum(lens), dtype=np.int32)  # padding tokens' logits are never used
    logits, kv = fwd(tokens, kv, md, real)
    out = [np.asarray(logits)]
    nxt = out[0][np.cumsum(lens) - 1].argmax(-1).astype(np.int32)
    greedy = [nxt]
    for step in range(steps):
        md = step_metadata([n + step for n in lens], [1] * 3, block_size=BS, blocks_per_seq=8)
        logits, kv = fwd(nxt, kv, md)
        out.append(np.asarray(logits))
        nxt = out[-1].argmax(-1).astype(np.int32)
        greedy.append(nxt)
    if mesh is not None:
        assert kv.k.sharding == sharding.pool_sharding(mesh)
    return prompts, np.stack(greedy, 1), out


# ---- the same numbers at every size -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_greedy(tiny):
    return greedy_logits(load_model(tiny).model)


@pytest.mark.parametrize("tp,backend", [(2, "xla"), (4, "xla"), (2, "pallas")])
def test_tiny_logits_match_one_device(tiny, tiny_greedy, tp, backend):
    _, want_tokens, want = tiny_greedy
    _, tokens, got = greedy_logits(load_model(tiny, attention_backend=backend, tensor_parallel_size=tp).model)
    np.testing.assert_array_equal(tokens, want_tokens)
    for step, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_engine_same_greedy_tokens(engines, tp):
    ref = engines[1][1]
    assert len({tuple(o.outputs[0].token_ids) for o in ref[0]}) == len(PROMPTS)  # not degenerate
    llm, passes, _ = engines[tp]
    for got, want in zip(passes, ref):
        assert_same_outputs(got, want)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert llm.runner.kv.k.sharding == sharding.pool_sharding(llm.runner.mesh)  # after donated steps
    assert engines[1][0].loaded.model.mesh is None  # tp=1: no mesh at all
    # tp=1 runs the per-layer CPU form (the reference above), tp > 1 the sharded stack.
    assert not engines[1][0].loaded.model.is_stacked and llm.loaded.model.is_stacked


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny_qwen(request, tmp_path_factory):
    """Qwen2 (q/k/v biases, sharded with their heads) and Qwen3 (q/k norms, replicated): built by
    the parent test, or now (importing torch) when this module runs on its own."""
    folders = os.environ.get("JAXPAGED_TP_QWEN")
    if folders:
        return folders.split(os.pathsep)[["qwen2", "qwen3"].index(request.param)]
    from conftest import make_tiny_qwen

    folder = tmp_path_factory.mktemp(request.param)
    make_tiny_qwen(folder, request.param, tie=request.param == "qwen2")
    return folder


def test_qwen_logits_and_embeddings_match_one_device(tiny_qwen):
    """The biases and norms Qwen adds are sharded (or replicated) so that two devices give one
    device's logits, greedy tokens and (through the engine) embeddings."""
    lm = load_model(tiny_qwen)
    assert lm.config.qkv_bias or lm.config.qk_norm
    _, want_tokens, want = greedy_logits(lm.model)
    sharded = load_model(tiny_qwen, tensor_parallel_size=2).model
    for name in ("bq", "bk", "bv") if lm.config.qkv_bias else ("q_norm", "k_norm"):
        x = getattr(sharded.layers, name)[...]
        split = 2 if name.startswith("b") else 1  # biases with their heads, norms replicated
        assert x.addressable_shards[0].data.shape == (x.shape[0], x.shape[1] // split, *x.shape[2:]), name
    _, tokens, got = greedy_logits(sharded)
    np.testing.assert_array_equal(tokens, want_tokens)
    for step, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=f"step {step}")
    # The engine's embeddings (hidden states, through chunked prefill steps) on two devices as on one.
    prompts = [p for p in PROMPTS if max(p) < lm.config.vocab_size]
    one, two = LLM(lm, **ENGINE), LLM(tiny_qwen, tensor_parallel_size=2, **ENGINE)
    for a, b in zip(two.embed(prompts, use_tqdm=False), one.embed(prompts, use_tqdm=False)):
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A Qwen2-MoE (8 experts, 2 a token, a shared expert): built by the parent test, or now."""
    folder = os.environ.get("JAXPAGED_TP_MOE")
    if folder:
        return folder
    from conftest import make_tiny_moe

    folder = tmp_path_factory.mktemp("qwen2_moe")
    make_tiny_moe(folder, "qwen2_moe")
    return folder


def test_moe_on_two_devices_matches_one(tiny_moe, tmp_path):
    """Every expert's (and the shared expert's) MLP width split over two devices: one device's
    logits and greedy tokens, straight through the model and through the engine (a LoRA adapter
    on the attention beside the base model), and one all-reduce for the experts in each layer,
    as for a dense MLP."""
    lm = load_model(tiny_moe)
    assert lm.config.moe.shared_intermediate_size
    _, want_tokens, want = greedy_logits(lm.model)
    sharded = load_model(tiny_moe, tensor_parallel_size=2).model
    for name, axis in (("we_gate", 3), ("we_up", 3), ("we_down", 2), ("ws_gate", 2), ("ws_up", 2), ("ws_down", 1),
                       ("router", None), ("ws_router", None)):
        x = getattr(sharded.layers, name)[...]
        shard = list(x.shape)
        if axis is not None:
            shard[axis] //= 2
        assert x.addressable_shards[0].data.shape == tuple(shard), name
    _, tokens, got = greedy_logits(sharded)
    np.testing.assert_array_equal(tokens, want_tokens)
    for step, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=f"step {step}")

    cfg, mesh = sharded.cfg, sharded.mesh
    graphdef, state = nnx.split(sharded)
    kv = init_kv_pool(cfg.num_layers, 1 + 3 * 8, cfg.num_kv_heads, BS, cfg.head_dim,
                      device=sharding.pool_sharding(mesh))
    md = step_metadata([5, 9, 2], [1] * 3, block_size=BS, blocks_per_seq=8)
    step = jax.jit(lambda state, tokens, kv, md: nnx.merge(graphdef, state)(tokens, kv, md))
    ops = collectives(step.lower(state, np.zeros(3, np.int32), kv, md).compile().as_text())
    in_layers = sorted((k, s, "attention" if "/attention/" in n else "mlp" if "/mlp/" in n else n)
                       for k, s, n in ops if "/while/body/" in n)
    assert in_layers == [("all-reduce", (3, cfg.hidden_size), "attention"),
                         ("all-reduce", (3, cfg.hidden_size), "mlp")], ops

    from paged import write_lora_adapter

    from jaxpaged import LoRARequest

    prompts = [p for p in PROMPTS if max(p) < cfg.vocab_size]
    lora = LoRARequest("a", 1, str(write_lora_adapter(tmp_path / "a", cfg, rank=4, alpha=8, modules=(
        "q_proj", "k_proj", "v_proj", "o_proj"))))
    loras = [lora if i % 2 == 0 else None for i in range(len(prompts))]
    one, two = LLM(lm, enable_lora=True, **ENGINE), LLM(tiny_moe, tensor_parallel_size=2, enable_lora=True, **ENGINE)
    want = one.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert_same_outputs(two.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False), want)
    base = one.generate(prompts[:1], GREEDY, use_tqdm=False)  # steps without an adapter: the program without LoRA
    assert_same_outputs(two.generate(prompts[:1], GREEDY, use_tqdm=False), base)
    assert want[0].outputs[0].token_ids != base[0].outputs[0].token_ids  # the adapter changes the tokens


def test_swap_preemption_keeps_the_pool_sharded(tiny, engines):
    """A pool too small for both sequences: one is swapped out to host memory and back."""
    llm = LLM(tiny, tensor_parallel_size=2, block_size=4, num_blocks=18, max_num_batched_tokens=16,
              preemption_mode="swap", swap_space="4MiB")
    assert_same_outputs(llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False), engines[1][1][0][2:])
    assert llm.stats()["num_swapped_out_blocks"] > 0
    assert llm.runner.kv.k.sharding == sharding.pool_sharding(llm.runner.mesh)


def test_float8_pool_on_two_devices_gives_one_devices_tokens(tiny):
    """A float8 pool, split by KV head: each device rounds and reads its own heads' bytes."""
    one, two = (LLM(tiny, tensor_parallel_size=tp, kv_cache_dtype="fp8", **ENGINE) for tp in (1, 2))
    assert_same_outputs(two.generate(PROMPTS, GREEDY, use_tqdm=False), one.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert two.runner.kv.k.dtype == np.uint8 and two.runner.kv.k.sharding == sharding.pool_sharding(two.runner.mesh)


def test_drafts_on_two_devices_give_the_same_tokens(tiny, engines):
    """Speculative decoding on a sharded model: the verification steps' rows (the last token's
    and each draft's) give the tokens and logprobs one device gives without drafts."""
    llm = LLM(tiny, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                                                "prompt_lookup_max": 2}, **ENGINE)
    assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), engines[1][1][0])
    assert llm.stats()["spec_num_draft_tokens"] > 0 and llm.stats()["num_used_blocks"] == 0


@pytest.fixture(scope="module")
def smollm():
    return load_model()


def test_default_model_tp3_same_tokens_and_logits(smollm):
    """SmolLM2-135M has 3 KV heads: tp=3 puts one KV head and three query heads on each device.

    Float32 logits of magnitude ~30 after thirty layers are only good to ~1e-4 on any device
    count: the same model run in float64 shows tp=1 itself 1.25e-4 off the exact logits
    (tp=3: 8.7e-5; tp=3 vs tp=1: 1.0e-4 on the prefill, <=9e-5 on decode steps, measured on
    an AMD EPYC; on an Intel Xeon, whose XLA:CPU dots round otherwise, tp=1 was 1.56e-4 off
    the exact logits and tp=3 vs tp=1 1.58e-4). So the checks are against the exact logits:
    tp=3 and tp=1 within 2e-4 of float64 (tp=3 measured 1.04e-4 off on the Xeon once the XLA
    attention loops read their last blocks in a half-chunk piece, another summation order),
    and the two within 3e-4 of each other. A wrong shard would be off by orders of magnitude
    more.
    """
    prompts, want_tokens, want = greedy_logits(smollm.model)
    _, tokens, got = greedy_logits(shard_model(smollm.model, 3))
    with jax.enable_x64(True):
        _, exact_tokens, exact = greedy_logits(load_model(dtype=np.float64).model)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(exact_tokens, want_tokens)
    for step, (a, b, e) in enumerate(zip(got, want, exact)):
        np.testing.assert_allclose(a, e, atol=2e-4, rtol=0, err_msg=f"tp=3 vs float64, step {step}")
        np.testing.assert_allclose(b, e, atol=2e-4, rtol=0, err_msg=f"tp=1 vs float64, step {step}")
        np.testing.assert_allclose(a, b, atol=3e-4, rtol=0, err_msg=f"tp=3 vs tp=1, step {step}")
        assert np.abs(a - b).max() > 0  # really two different computations

    llm = LLM(smollm, tensor_parallel_size=3, num_blocks=32)
    assert llm.runner.kv.k.addressable_shards[0].data.shape[2] == 1  # one KV head per device
    sp = SamplingParams(temperature=0, max_tokens=want_tokens.shape[1], ignore_eos=True)
    outs = llm.generate([p.tolist() for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_tokens.tolist()


# ---- where the arrays live ------------------------------------------------------------


def per_device_bytes(arrays, device):
    return sum(s.data.nbytes for a in jax.tree.leaves(arrays) for s in a.addressable_shards if s.device == device)


def test_weights_and_pool_split_evenly(engines):
    llm = engines[4][0]
    params, kv = llm.runner.param_state(), llm.runner.kv
    got = jax.tree.map(lambda a: a.sharding.spec, nnx.to_pure_dict(params))
    assert got == sharding.param_specs(llm.config, 4)
    total_w = sum(a.nbytes for a in jax.tree.leaves(params))
    norms = sum(a.nbytes for a in jax.tree.leaves(params) if a.sharding.is_fully_replicated)
    assert norms < 0.01 * total_w
    for d in jax.devices():
        assert per_device_bytes(params, d) == (total_w - norms) // 4 + norms
        assert per_device_bytes(kv, d) == kv.k.nbytes * 2 // 4


# ---- the compiled step ----------------------------------------------------------------

_KINDS = r"(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter|collective-broadcast)(?:-start)?\("
_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* " + _KINDS)


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(kind, result shape, op_name) of every collective in an HLO module's text."""
    out = []
    for line in hlo.splitlines():
        if m := _COLLECTIVE.search(line):
            name = re.search(r'op_name="([^"]*)"', line)
            out.append((m.group(3), tuple(int(d) for d in m.group(2).split(",") if d), name.group(1) if name else ""))
    assert len(out) == len(re.findall(_KINDS, hlo)), "a collective with a tuple result: parse it too"
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_step_hlo_has_two_all_reduces_per_layer_and_no_pool_gather(engines, tp):
    llm, _, calls = engines[tp]
    cfg = llm.config
    NB, BS = ENGINE["num_blocks"], ENGINE["block_size"]
    full_pool = (cfg.num_layers, NB, cfg.num_kv_heads, BS, cfg.head_dim)
    pool_shard = (cfg.num_layers, NB, cfg.num_kv_heads // tp, BS, cfg.head_dim)
    for decode, what in ((False, "prefill"), (True, "decode")):
        args, kwargs = calls[decode]
        hlo = llm.runner.programs.forward.lower(*args, **kwargs).compile().as_text()
        ops = collectives(hlo)
        T = next(s[0] for k, s, _ in ops if k == "all-reduce")  # padded tokens of the step
        in_layers = sorted((k, s, "attention" if "/attention/" in n else "mlp" if "/mlp/" in n else n)
                           for k, s, n in ops if "/while/body/" in n)
        once = sorted((k, s) for k, s, n in ops if "/while/body/" not in n)
        # The scan body, run once per layer: the row-parallel wo and w_down, nothing else.
        assert in_layers == [("all-reduce", (T, cfg.hidden_size), "attention"),
                             ("all-reduce", (T, cfg.hidden_size), "mlp")], (what, ops)
        # Once per step: the gather of the [S, V] logits and the vocab-parallel embedding lookup.
        assert len(once) == 2 and once[0][0] == "all-gather" and once[0][1][1] == cfg.vocab_size, (what, ops)
        assert once[1] == ("all-reduce", (T, cfg.hidden_size)), (what, ops)
        # The pool exists only as per-device shards, and the step updates it in place.
        assert hlo_shape(pool_shard) in hlo and hlo_shape(full_pool) not in hlo, what
        alias = re.search(r"input_output_alias=\{(.*?) \}", hlo).group(1)  # donated k and v
        assert alias.count("-alias") == 2, alias


def hlo_shape(shape, dtype="f32"):
    return f"{dtype}[{','.join(map(str, shape))}]"


# ---- lowered for TPU and GPU ----------------------------------------------------------


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "ragged"])
def test_tp3_step_lowers_to_the_platforms_kernel_per_shard(decode):
    """``tensor_parallel_size=3``, backend "auto": the step lowered for TPU holds the Mosaic
    kernel, for CUDA the Triton one, for CPU neither, and the kernel's operands are each
    device's slice of the pool (one of 3 KV heads), not the whole pool."""
    from test_backends import MOSAIC, TRITON, attention_args, i32, kernels_in

    cfg = LlamaConfig(vocab_size=384, hidden_size=96, intermediate_size=192, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64)
    model = shard_model(Llama(cfg, attention_backend="auto", rngs=nnx.Rngs(0)), 3)
    cpu_mesh = model.mesh
    # For CUDA the mesh is 3 abstract GPUs in the same layout: inside the shard_map, jax 0.12
    # asks the mesh's device for the GPU the Triton kernel is for (a CPU mesh has none), and
    # jax 0.10 / 0.11 lower the same program from either. (Not compat.abstract_gpu: its
    # one-device abstract mesh would clash with the "tp" one.)
    gpus = jax.sharding.AbstractMesh(cpu_mesh.axis_sizes, cpu_mesh.axis_names, axis_types=cpu_mesh.axis_types,
                                     abstract_device=jax.sharding.AbstractDevice(
                                         device_kind="NVIDIA H100", num_cores=None, platform="cuda"))
    NB, block_size = 32, 16  # Mosaic takes whole sublane tiles (8 rows); BS = 4 is not
    q, _, _, md = attention_args(decode)
    forward = jaxpaged.runner.StepPrograms().forward
    lowered = {}
    for platform in ("tpu", "cuda", "cpu"):
        mesh = gpus if platform == "cuda" else cpu_mesh
        model.mesh = mesh
        structure, params = jaxpaged.runner.split_model(model)
        params = jax.tree.map(lambda x: _abstract(x, mesh), params)
        pool = jax.ShapeDtypeStruct((cfg.num_layers, NB, cfg.num_kv_heads, block_size, cfg.head_dim), np.float32,
                                    sharding=sharding.pool_sharding(mesh))
        args = (structure, params, KVPool(pool, pool), i32(q.shape[:1]), md, i32(md.context_lens.shape))
        lowered[platform] = forward.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert {p: kernels_in(h) for p, h in lowered.items()} == {"tpu": {"mosaic"}, "cuda": {"triton"}, "cpu": set()}
    shard_view = f"tensor<{cfg.num_layers * NB}x1x{block_size}x{cfg.head_dim}xf32>"  # [L * NB, KVH / 3, BS, D]
    for platform, marker in (("tpu", MOSAIC), ("cuda", TRITON)):
        calls = [line for line in lowered[platform].splitlines() if marker in line]
        assert len(calls) == 1 and calls[0].count(shard_view) == 2, (platform, calls)  # k and v


# ---- errors ----------------------------------------------------------------------------


def test_bad_sizes_are_explained(tiny):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's 4 KV heads; "
                                         r"valid sizes for this model: 1, 2, 4"):
        LLM(tiny, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"needs 8 devices, but only 4 cpu device\(s\) exist.*"
                                         r"XLA_FLAGS=--xla_force_host_platform_device_count=8"):
        LLM(tiny, tensor_parallel_size=8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be >= 1"):
        LLM(tiny, tensor_parallel_size=0)


def test_default_model_valid_sizes(smollm):
    with pytest.raises(ValueError, match=r"does not divide the model's 3 KV heads; valid sizes for this model: 1, 3"):
        shard_model(smollm.model, 2)


def test_cli_flag(tiny, capsys):
    assert cli_main(["hello", "--model", str(tiny), "--tensor-parallel-size", "3", "--no-progress"]) == 1
    assert "valid sizes for this model: 1, 2, 4" in capsys.readouterr().err


def test_lora_on_two_devices_gives_one_devices_tokens(tiny, engines, tmp_path):
    """LoRA adapters over a sharded model (their weights replicated): the tokens and logprobs of
    one device's engine, beside requests of the base model."""
    from paged import write_lora_adapter

    from jaxpaged import LoRARequest

    cfg = load_model(tiny).config
    lora = LoRARequest("a", 1, str(write_lora_adapter(tmp_path / "a", cfg, rank=4, alpha=8, modules=(
        "q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))))
    loras = [lora, None, lora, None]
    one, two = (LLM(tiny, tensor_parallel_size=tp, enable_lora=True, **ENGINE) for tp in (1, 2))
    want = one.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
    assert_same_outputs(two.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False), want)
    base = engines[1][1][0]
    assert want[0].outputs[0].token_ids != base[0].outputs[0].token_ids  # the adapter changes the tokens
    assert_same_outputs([want[1], want[3]], [base[1], base[3]])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_the_shards(tiny, engines, level):
    """Sleep mode on two devices: the weights and the pool let go, back sharded as they were
    (level 2 loads the checkpoint again), and the same tokens as before."""
    llm = LLM(tiny, tensor_parallel_size=2, enable_sleep_mode=True, **ENGINE)
    layout = [a.sharding for a in llm.runner.params], llm.runner.kv.k.sharding
    llm.sleep(level)
    assert llm.runner.params is None and llm.runner.kv is None
    llm.wake_up()
    assert ([a.sharding for a in llm.runner.params], llm.runner.kv.k.sharding) == layout
    want = [o.outputs[0].token_ids for o in engines[2][1][0]]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    llm.update_weights(load_file(os.path.join(tiny, "model.safetensors")))  # the same weights, in memory
    assert ([a.sharding for a in llm.runner.params], llm.runner.kv.k.sharding) == layout
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
