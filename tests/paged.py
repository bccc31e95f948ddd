"""Test helpers: a trivial allocator (sequence i owns consecutive blocks, after the null
block), the model's jitted forward, the precision of every dot in a jaxpr, and a model's
prefill and decode steps against transformers'."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxpaged.attention import AttentionMetadata


def step_metadata(cached: list[int], new: list[int], *, block_size: int, blocks_per_seq: int,
                  pad_tokens: int = 0, pad_seqs: int = 0) -> AttentionMetadata:
    """Metadata for one step where sequence i has ``cached[i]`` tokens in the pool and adds ``new[i]``.

    Sequence i owns blocks ``1 + i * blocks_per_seq ...``; ``pad_tokens`` / ``pad_seqs``
    append padding the way the engine's batch builder does.
    """
    S = len(cached)
    positions, slots, qsl = [], [], [0]
    for i, (c, n) in enumerate(zip(cached, new)):
        pos = np.arange(c, c + n)
        positions.append(pos)
        slots.append((1 + i * blocks_per_seq + pos // block_size) * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
    positions.append(np.zeros(pad_tokens, np.int64))
    slots.append(np.zeros(pad_tokens, np.int64))  # padding writes into the null block
    tables = 1 + np.arange(S)[:, None] * blocks_per_seq + np.arange(blocks_per_seq)[None, :]
    tables = np.concatenate([tables, np.zeros((pad_seqs, blocks_per_seq), np.int64)])
    ctx = np.array([c + n for c, n in zip(cached, new)] + [0] * pad_seqs)
    qsl = np.array(qsl + [qsl[-1]] * pad_seqs)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    return AttentionMetadata(
        positions=i32(np.concatenate(positions)), slot_mapping=i32(np.concatenate(slots)),
        block_tables=i32(tables), context_lens=i32(ctx), query_start_loc=i32(qsl),
    )


def jit_forward(model):
    """The model's forward, jitted with its params as arguments (not baked-in constants)."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, kv, md, logits_indices):
        return nnx.merge(graphdef, state)(tokens, kv, md, logits_indices)

    return lambda tokens, kv, md, logits_indices=None: fwd(state, tokens, kv, md, logits_indices)


def dot_precisions(jaxpr) -> list:
    """The ``precision`` of every dot_general in ``jaxpr``, kernels and loop bodies included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += dot_precisions(inner)
    return found


def write_lora_adapter(folder, cfg, *, rank: int, alpha: float, modules: tuple[str, ...], seed: int = 0,
                       std: float = 0.1):
    """A PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``) of random A and B
    for every layer's ``modules`` of a model of config ``cfg``, written without torch."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    from jaxpaged.lora import module_shapes

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            n_in, n_out = module_shapes(cfg)[m]
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = (std * rng.standard_normal((rank, n_in))).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (std * rng.standard_normal((n_out, rank))).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none"}))
    return folder


def hf_logits(hf, ids):
    """A transformers model's logits ``[len(ids), V]`` for one sequence (float32 numpy)."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def assert_prefill_then_decode_match_hf(model, cfg, hf, *, label: str, block_size: int, steps: int = 4):
    """Two random sequences prefilled in one step, then ``steps`` random tokens decoded a step,
    through ``model`` over a fresh pool: every logit within 1e-4 of ``hf``'s on the same ids."""
    from jaxpaged.kv_cache import init_kv_pool

    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (13, 6)]
    per_seq = 8
    kv = init_kv_pool(cfg.num_layers, 1 + per_seq * len(seqs), cfg.num_kv_heads, block_size, cfg.head_dim)
    md = step_metadata([0, 0], [len(s) for s in seqs], block_size=block_size, blocks_per_seq=per_seq)
    logits, kv = model(np.array(sum(seqs, []), np.int32), kv, md)
    np.testing.assert_allclose(np.asarray(logits[:len(seqs[0])]), hf_logits(hf, seqs[0]), atol=1e-4, rtol=0)
    for step in range(steps):
        nxt = [int(rng.integers(0, cfg.vocab_size)) for _ in seqs]
        md = step_metadata([len(s) for s in seqs], [1, 1], block_size=block_size, blocks_per_seq=per_seq)
        logits, kv = model(np.array(nxt, np.int32), kv, md)
        for i, (s, t) in enumerate(zip(seqs, nxt)):
            s.append(t)
            np.testing.assert_allclose(np.asarray(logits[i]), hf_logits(hf, s)[-1], atol=1e-4, rtol=0,
                                       err_msg=f"{label} sequence {i}, step {step}")
