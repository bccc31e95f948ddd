"""Mixtures of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) against Hugging Face's
PyTorch models in float32: the expert layer on both of its paths against a per-token numpy loop,
the model in its three forms, the engine's greedy tokens and logprobs, what a checkpoint lacks, what
is refused, and the step lowered for TPU and GPU with a native grouped matmul."""

import dataclasses
import json
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import MOE_ARCHS, QWEN_SHAPES, make_tiny_moe
from paged import assert_prefill_then_decode_match_hf, hf_logits, step_metadata

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.config import LlamaConfig, MoeConfig
from jaxpaged.kv_cache import init_kv_pool
from jaxpaged.loader import CheckpointError, load_model
from jaxpaged.lora import LoRAConfig, LoRAManager, LoRASlots
from jaxpaged.model import moe_mlp
from jaxpaged.pallas.moe_matmul import align_to_tiles, default_block_t, moe_matmul, num_tiles

BS = 4


@pytest.fixture(scope="module", params=list(MOE_ARCHS))
def tiny_moe(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    return arch, folder, make_tiny_moe(folder, arch)


# ---- the expert layer alone -------------------------------------------------------------


def numpy_moe(h, w, moe: MoeConfig):
    """Each token on its own, in float64: softmax, the top-k experts, their SwiGLU outputs summed."""
    h = h.astype(np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}

    def silu(x):
        return x / (1 + np.exp(-x))

    out = np.zeros_like(h)
    for t, x in enumerate(h):
        logits = x @ w["router"]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:moe.top_k]
        weights = p[top] / p[top].sum() if moe.norm_topk_prob else p[top]
        for e, a in zip(top, weights):
            out[t] += a * (silu(x @ w["we_gate"][e]) * (x @ w["we_up"][e])) @ w["we_down"][e]
        if moe.shared_intermediate_size:
            shared = (silu(x @ w["ws_gate"]) * (x @ w["ws_up"])) @ w["ws_down"]
            out[t] += shared / (1 + np.exp(-(x @ w["ws_router"])))
    return out


@pytest.mark.parametrize("tokens, norm, shared", [(1, True, 0), (3, False, 24), (40, True, 24), (40, False, 0)],
                         ids=["1-renormalised", "3-raw-probs-shared-expert", "40-renormalised-shared-expert",
                              "40-raw-probs"])
def test_expert_layer_paths_match_a_per_token_loop(tokens, norm, shared):
    """The grouped product (ragged_dot over the pairs sorted by expert), the Triton kernel
    (interpreted) and the CPU form's loop over each expert's arrays give each token's own top-k
    sum, whatever the batch: experts that get no token, several tokens sharing an expert, runs
    longer than a tile or a chunk (40 tokens)."""
    moe = MoeConfig(num_experts=6, top_k=2, intermediate_size=20, norm_topk_prob=norm, shared_intermediate_size=shared)
    D = 16
    rng = np.random.default_rng(tokens * 10 + norm + shared)
    shapes = {"router": (D, 6), "we_gate": (6, D, 20), "we_up": (6, D, 20), "we_down": (6, 20, D)}
    if shared:
        shapes |= {"ws_gate": (D, shared), "ws_up": (D, shared), "ws_down": (shared, D), "ws_router": (D,)}
    w = {k: rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-2] if len(s) > 1 else D) for k, s in shapes.items()}
    w["router"] *= 4  # sharp routing: the top-k is not a near tie that float32 could flip
    h = rng.standard_normal((tokens, D)).astype(np.float32)
    own = {f"we_gate_up_{e}": np.concatenate([w["we_gate"][e], w["we_up"][e]], axis=1) for e in range(6)}
    own |= {f"we_down_{e}": w["we_down"][e] for e in range(6)}  # the CPU form's arrays
    if shared:
        own["ws_gate_up"] = np.concatenate([w["ws_gate"], w["ws_up"]], axis=1)
    params = types.SimpleNamespace(**{k: jnp.asarray(v) for k, v in (w | own).items()})
    want = numpy_moe(h, w, moe)
    # The kernel reads layer 1 of stacks whose other layers are other weights.
    stacks = tuple(jnp.stack([jnp.asarray(rng.standard_normal(w[n].shape), jnp.float32), jnp.asarray(w[n])])
                   for n in ("we_gate", "we_up", "we_down"))
    for experts in ("grouped", "per_expert", "pallas"):
        got = np.asarray(moe_mlp(jnp.asarray(h), params, moe, jax.lax.Precision.HIGHEST, experts=experts,
                                 stacks=stacks, layer=1, interpret=True))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=experts)


@pytest.mark.parametrize("experts", ["grouped", "per_expert"])
def test_a_16bit_router_picks_the_experts_of_a_float32_softmax(experts):
    """A bfloat16 model's routing, as transformers' and vLLM's: the router's logits rounded to
    bfloat16, the softmax over them in float32, so a token's experts are its k largest logits
    (in bfloat16 probabilities within its ~0.4% step tied, and the lower expert won). Each expert
    writes only its own output channel, so the channels a token's output fills are its experts.
    The stacked form (bfloat16 activations) and the CPU form of a bfloat16 model (float32)."""
    E, K, D, F, T = 64, 8, 64, 16, 512
    rng = np.random.default_rng(0)
    moe = MoeConfig(num_experts=E, top_k=K, intermediate_size=F, norm_topk_prob=True)
    down = np.zeros((E, F, D), np.float32)
    down[np.arange(E), :, np.arange(E)] = rng.uniform(0.5, 1.0, (E, F))
    w = {"router": rng.normal(0, 0.5 / np.sqrt(D), (D, E)), "we_gate": rng.normal(0, D ** -0.5, (E, D, F)),
         "we_up": rng.normal(0, D ** -0.5, (E, D, F)), "we_down": down}
    w |= {f"we_gate_up_{e}": np.concatenate([w["we_gate"][e], w["we_up"][e]], axis=1) for e in range(E)}
    w |= {f"we_down_{e}": down[e] for e in range(E)}
    params = types.SimpleNamespace(**{k: jnp.asarray(v, jnp.bfloat16) for k, v in w.items()})
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16 if experts == "grouped" else jnp.float32)
    y = np.asarray(moe_mlp(h, params, moe, None, experts=experts), np.float32)
    logits = np.asarray(jax.lax.dot_general(h, params.router, (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32)
    ranked = -np.sort(-logits, axis=1)
    clear = ranked[:, K - 1] > ranked[:, K]  # a tie at the k-th place goes either way
    assert clear.mean() > 0.9
    want = np.sort(np.argsort(-logits, axis=1, kind="stable")[:, :K], axis=1)
    got = np.array([np.flatnonzero(row) for row in y])  # K experts a token: K channels
    assert got.shape == (T, K)
    wrong = np.flatnonzero(clear & (got != want).any(axis=1))
    assert wrong.size == 0, (f"{wrong.size} of {clear.sum()} tokens routed elsewhere", wrong[:5])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 70), st.integers(1, 9), st.sampled_from([1, 2, 16]), st.data())
def test_tile_plan_puts_every_pair_once_in_a_tile_of_its_expert(M, E, block_t, data):
    experts = np.array(data.draw(st.lists(st.integers(0, E - 1), min_size=M, max_size=M)), np.int32)
    plan = align_to_tiles(jnp.asarray(experts), E, block_t)
    rows, tile_expert, slot = (np.asarray(a) for a in plan)
    G = num_tiles(M, E, block_t)
    assert rows.shape == (G * block_t,) and tile_expert.shape == (G,)
    assert np.array_equal(rows[slot], np.arange(M))  # each pair in its slot, once
    assert sorted(rows[rows < M]) == list(range(M)) and np.all(rows[rows >= M] == M)
    assert np.array_equal(tile_expert[slot // block_t], experts)  # its tile is its expert's
    used = tile_expert >= 0
    assert np.all(used[:used.sum()])  # the used tiles first,
    assert np.all(np.diff(tile_expert[used]) >= 0)  # in expert order, each expert's together
    for e in range(E):  # each expert's run in pair order, as few tiles as its pairs need
        assert np.array_equal(rows[np.sort(slot[experts == e])], np.flatnonzero(experts == e))
        assert (tile_expert == e).sum() == -(-(experts == e).sum() // block_t)


class TestMoeKernel:
    """The Triton kernel, interpreted here; natively on a GPU (``TestMoeKernelNative``)."""

    INTERPRET = True

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("M", [3, 23, 300])
    def test_rows_times_their_experts_weights(self, M, dtype):
        """Each pair's row times its expert's weights of the layer asked for, padding rows and
        unused tiles zero, against a float32 product of the same values."""
        rng = np.random.default_rng(M)
        L, E, K, N = 2, 5, 64, 96
        experts = jnp.asarray(rng.integers(0, E, M), jnp.int32)
        plan = align_to_tiles(experts, E, default_block_t(M, E))
        x = jnp.asarray(rng.standard_normal((M, K)), dtype)
        w = jnp.asarray(rng.standard_normal((L, E, K, N)) / 8, dtype)
        xs = jnp.where((plan.rows < M)[:, None], x[jnp.minimum(plan.rows, M - 1)], 0)
        y = np.asarray(moe_matmul(xs, w, 1, plan.tile_expert, interpret=self.INTERPRET), np.float32)
        want = np.einsum("mk,mkn->mn", np.asarray(x, np.float32), np.asarray(w, np.float32)[1][np.asarray(experts)])
        tol = dict(atol=2e-4, rtol=1e-5) if dtype == jnp.float32 else dict(atol=3e-2, rtol=2e-2)
        np.testing.assert_allclose(y[np.asarray(plan.slot)], want, **tol)
        assert not y[np.asarray(plan.rows) == M].any()  # padding rows and unused tiles

    def test_expert_layer_against_a_per_token_loop(self):
        moe = MoeConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True)
        rng = np.random.default_rng(4)
        D = 64
        w = {"router": 2 * rng.standard_normal((D, 8)) / 8, "we_gate": rng.standard_normal((8, D, 32)) / 8,
             "we_up": rng.standard_normal((8, D, 32)) / 8, "we_down": rng.standard_normal((8, 32, D)) / 6}
        w = {k: v.astype(np.float32) for k, v in w.items()}
        h = rng.standard_normal((37, D)).astype(np.float32)
        stacks = tuple(jnp.asarray(w[n])[None] for n in ("we_gate", "we_up", "we_down"))
        got = moe_mlp(jnp.asarray(h), types.SimpleNamespace(**{k: jnp.asarray(v) for k, v in w.items()}), moe,
                      jax.lax.Precision.HIGHEST, experts="pallas", stacks=stacks, layer=0, interpret=self.INTERPRET)
        np.testing.assert_allclose(np.asarray(got), numpy_moe(h, w, moe), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the native kernel needs a GPU")
class TestMoeKernelNative(TestMoeKernel):
    INTERPRET = False


def test_kernel_lowers_for_cuda_and_checks_its_inputs():
    """The Triton lowering of a launch (tiles of 16 rows for a decode step's few pairs)."""
    from jaxpaged.compat import abstract_gpu

    M, E = 23, 5
    plan = align_to_tiles(jnp.asarray(np.arange(M) % E, jnp.int32), E, default_block_t(M, E))
    xs = jnp.zeros((plan.rows.shape[0], 64), jnp.bfloat16)
    w = jnp.zeros((2, E, 64, 96), jnp.bfloat16)
    assert default_block_t(M, E) == 16 and default_block_t(2048, 8) == 64
    with abstract_gpu():
        hlo = jax.jit(lambda xs, w, te: moe_matmul(xs, w, 0, te, interpret=False)).trace(
            xs, w, plan.tile_expert).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo and "moe_matmul_t16_n32_k64" in hlo
    with pytest.raises(ValueError, match="expected one dtype"):
        moe_matmul(xs.astype(jnp.float32), w, 0, plan.tile_expert)


# ---- the model and the engine -----------------------------------------------------------


def test_config_reads_each_architectures_experts(tiny_moe):
    arch, folder, _ = tiny_moe
    cfg = LlamaConfig.from_hf(json.loads((folder / "config.json").read_text()))
    a = MOE_ARCHS[arch]
    moe = cfg.moe
    assert moe.num_experts == a.get("num_local_experts", a.get("num_experts"))
    assert moe.top_k == a["num_experts_per_tok"]
    assert moe.intermediate_size == a.get("moe_intermediate_size", a.get("intermediate_size"))
    assert moe.norm_topk_prob == (arch == "mixtral" or a.get("norm_topk_prob"))
    assert moe.shared_intermediate_size == a.get("shared_expert_intermediate_size", 0)
    assert (cfg.qkv_bias, cfg.qk_norm) == (arch == "qwen2_moe", arch == "qwen3_moe")


@pytest.mark.parametrize("form", ["stacked", "out_in"])
def test_prefill_then_decode_match_hf(tiny_moe, form):
    """Two sequences prefilled in one step, then decoded a token a step, in the stacked form
    (ragged_dot: GPU, TPU, tensor parallelism) and the CPU form (a loop over each expert's
    arrays) in its ``[out, in]`` layout (the engine's tests below run the ``[in, out]`` one,
    the layout of models this small)."""
    arch, folder, hf = tiny_moe
    lm = load_model(folder, dtype=np.float32, attention_backend="xla")
    model = lm.model if form == "stacked" else lm.model.unstacked(form)
    assert_prefill_then_decode_match_hf(model, lm.config, hf, label=arch, block_size=BS, steps=3)


def test_engine_greedy_tokens_and_logprobs_match_hf(tiny_moe):
    """Greedy tokens through the engine (chunked prefill, decode batches of 1-4 rows) are
    transformers' model's, each token's logprob its log-softmax."""
    arch, folder, hf = tiny_moe
    llm = LLM(load_model(folder, dtype=np.float32), num_blocks=64, block_size=BS, max_num_batched_tokens=16,
              debug_checks=True)
    prompts = [np.random.default_rng(10 + i).integers(0, QWEN_SHAPES["vocab_size"], 4 + 5 * i).tolist()
               for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        want = []  # greedy by hand: generate()'s min_new_tokens would mask Mixtral's EOS, ignore_eos does not
        for _ in range(10):
            want.append(int(hf_logits(hf, p + want)[-1].argmax()))
        got = o.outputs[0]
        assert got.token_ids == want, arch
        logits = hf_logits(hf, p + want)[len(p) - 1:-1]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
            -1, keepdims=True)
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, want)],
                                   logp[np.arange(len(want)), want], atol=1e-4)
    assert llm.stats()["num_used_blocks"] == 0


def test_a_missing_expert_is_named(tiny_moe, tmp_path):
    from safetensors.numpy import load_file, save_file

    arch, folder, _ = tiny_moe
    block, up = ("block_sparse_moe", "w3") if arch == "mixtral" else ("mlp", "up_proj")
    tensors = load_file(folder / "model.safetensors")
    del tensors[f"model.layers.1.{block}.experts.2.{up}.weight"]
    del tensors[f"model.layers.0.{block}.experts.1.{up}.weight"]
    tensors[f"model.layers.0.{block}.experts.9.{up}.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert (f"missing tensor model.layers.0.{block}.experts.1.{up}.weight, "
            f"model.layers.1.{block}.experts.2.{up}.weight") in msg, msg  # each, not {0,1} x {1,2}
    assert f"unexpected tensor 'model.layers.0.{block}.experts.9.{up}.weight'" in msg, msg


def test_keys_left_out_take_transformers_defaults():
    base = dict(QWEN_SHAPES, model_type="qwen2_moe")
    del base["intermediate_size"]  # unused by an all-expert model
    for model_type, (experts, top_k, width, shared) in {"mixtral": (8, 2, 14336, 0), "qwen2_moe": (60, 4, 1408, 5632),
                                                         "qwen3_moe": (128, 8, 768, 0)}.items():
        moe = LlamaConfig.from_hf(base | {"model_type": model_type}).moe
        assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (
            experts, top_k, width, shared), model_type
    no_shared = LlamaConfig.from_hf(base | {"shared_expert_intermediate_size": 0})
    assert no_shared.moe.shared_intermediate_size == 0


@pytest.mark.parametrize("change, match", [
    ({"mlp_only_layers": [1]}, r"dense MLP layers among the expert layers \(mlp_only_layers=\[1\]"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2\)"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be between 1 and num_experts=8"),
    ({"num_experts": 0}, r"num_experts_per_tok=2 must be between 1 and num_experts=0"),
])
def test_unsupported_expert_configs_are_refused(change, match):
    d = dict(QWEN_SHAPES, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    LlamaConfig.from_hf(d)  # as it is, accepted
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(d | change)


def test_dp_attention_is_refused_before_loading(tiny_moe, monkeypatch):
    arch, folder, _ = tiny_moe
    import jaxpaged.engine

    def never(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(jaxpaged.engine, "load_model", never)
    with pytest.raises(ValueError, match="enable_dp_attention is not supported for a mixture-of-experts model"):
        LLM(str(folder), enable_dp_attention=True, data_parallel_size=2)


def test_lora_on_the_attention_matches_peft(tiny_moe, tmp_path):
    """LoRA adapters on a mixture of experts update its attention projections (as vLLM's LoRA did
    for MoE models before its fused-experts kernels): two adapters and the base model in one
    batch, prefilled in one step of the stacked form and generated by the engine (the CPU form),
    against PEFT's model of each; an adapter with a tensor for the MLP is refused, named."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.numpy import load_file, save_file

    arch, folder, hf = tiny_moe
    lm = load_model(folder, dtype=np.float32)
    models, requests = {None: hf}, {}
    options = {"qkvo": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
               "qv": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True)}
    for i, (name, opts) in enumerate(options.items(), 1):
        torch.manual_seed(i)
        pm = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **opts)).eval()
        pm.save_pretrained(tmp_path / name)
        models[name], requests[name] = pm, LoRARequest(name, i, str(tmp_path / name))
    rng = np.random.default_rng(3)
    names = ["qkvo", None, "qv", "qkvo"]
    prompts = [rng.integers(0, QWEN_SHAPES["vocab_size"], 5 + 3 * i).tolist() for i in range(len(names))]
    for p in prompts[:1]:  # the adapters do change the logits (else the comparisons would prove nothing)
        assert all(np.abs(hf_logits(models[n], p) - hf_logits(hf, p)).max() > 0.05 for n in options)

    manager = LoRAManager(lm.config, LoRAConfig(max_loras=2, max_lora_rank=4))
    slots = LoRASlots(lm.config, manager.config, np.float32, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    slot_of = slots.slots({requests[n].lora_int_id: manager.get(requests[n]) for n in options})
    new = [len(p) for p in prompts]
    md = step_metadata([0] * len(prompts), new, block_size=BS, blocks_per_seq=4)
    kv = init_kv_pool(lm.config.num_layers, 1 + 4 * len(prompts), lm.config.num_kv_heads, BS, lm.config.head_dim)
    token_slots = np.repeat([-1 if n is None else slot_of[requests[n].lora_int_id] for n in names], new)
    logits, _ = lm.model(np.concatenate(prompts).astype(np.int32), kv, md, logits_indices=np.cumsum(new) - 1,
                         lora=(token_slots.astype(np.int32), slots.weights))
    for row, n, p in zip(np.asarray(logits), names, prompts):
        np.testing.assert_allclose(row, hf_logits(models[n], p)[-1], atol=1e-4, rtol=0, err_msg=f"{arch} {n}")

    llm = LLM(lm, num_blocks=64, block_size=BS, enable_lora=True, max_loras=2, max_lora_rank=4, debug_checks=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        lora_request=[n and requests[n] for n in names], use_tqdm=False)
    for p, n, o in zip(prompts, names, outs):
        want = []
        for _ in range(6):
            want.append(int(hf_logits(models[n], p + want)[-1].argmax()))
        assert o.outputs[0].token_ids == want, (arch, n)
    assert llm.stats()["num_used_blocks"] == 0

    mlp = tmp_path / "mlp"  # with a rank_pattern, as PEFT's "all-linear" writes for the experts: the tensor is named
    shutil.copytree(tmp_path / "qv", mlp)
    conf = json.loads((mlp / "adapter_config.json").read_text())
    (mlp / "adapter_config.json").write_text(json.dumps(conf | {"rank_pattern": {r".*\.gate_up_proj": 2}}))
    tensors = load_file(mlp / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    save_file({**tensors, key: np.ones((2, QWEN_SHAPES["hidden_size"]), np.float32)}, mlp / "adapter_model.safetensors")
    only = r"q_proj, k_proj, v_proj, o_proj \(a mixture of experts: its attention only\)"
    with pytest.raises(ValueError, match=f"tensor '{key}' is not a LoRA update this engine applies .*{only}"):
        llm.add_request([1, 2], SamplingParams(max_tokens=1), lora_request=LoRARequest("mlp", 9, str(mlp)))


def test_a_gguf_with_experts_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(tmp_path / "moe.gguf", "llama")
    w.add_block_count(2)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"a mixture of experts \(llama.expert_count=8\) is not supported from GGUF"):
        load_model(tmp_path / "moe.gguf", use_cache=False)


@pytest.mark.parametrize("tiny_moe", ["qwen2_moe", "qwen3_moe"], indirect=True)
def test_sleep_and_update_weights_keep_the_experts(tiny_moe):
    """Sleep mode and update_weights go through every param, the experts' stacks included (with
    and without a shared expert)."""
    from safetensors.numpy import load_file

    arch, folder, _ = tiny_moe
    llm = LLM(str(folder), num_blocks=32, block_size=BS, enable_sleep_mode=True)
    prompt = [[3, 14, 15, 92, 65]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == want, level
    tensors = load_file(folder / "model.safetensors")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    llm.update_weights({k: (v * 0 if f"{block}.experts." in k else v) for k, v in tensors.items()})
    zeroed = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    if arch != "qwen2_moe":  # without the shared expert, the MLPs now add nothing
        assert zeroed != want
    llm.update_weights(tensors)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == want


# ---- accelerators ------------------------------------------------------------------------


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "ragged"])
def test_step_lowers_with_a_grouped_matmul(platform, decode):
    """On TPU the experts run as XLA's ragged dot (three a layer: gate, up, down), on GPU as
    three launches of the Triton kernel reading the stacks in place (no ragged dot left), beside
    the platform's attention kernel, the pool still donated; on CPU jax expands the ragged dot."""
    import jaxpaged.runner
    from test_backends import EXPECTED, TINY, kernels_in, lower, step_args

    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=64, norm_topk_prob=True)
    cfg = dataclasses.replace(TINY, moe=moe)
    forward = jaxpaged.runner.StepPrograms().forward
    hlo = lower(forward, *step_args(decode, cfg=cfg), platform=platform)
    assert kernels_in(hlo) == EXPECTED[platform]
    ragged, kernel = hlo.count('"chlo.ragged_dot"('), hlo.count("call @_moe_matmul(")
    assert (ragged, kernel) == ((3, 0) if platform == "tpu" else (0, 3))
    assert hlo.count("tf.aliasing_output") == 2
    assert "ragged_dot" not in lower(forward, *step_args(decode, cfg=cfg), platform="cpu")
