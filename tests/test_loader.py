"""Weight loading: every bad checkpoint raises one clear error naming the file and the tensor."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged.loader import CheckpointError, load_model

from conftest import make_tiny_hf, production_env


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    make_tiny_hf(folder, tie=False, llama3=False)
    return folder


def variant(good_folder, tmp_path, edit=None, config_edit=None):
    """A copy of the good checkpoint with its tensors and/or config edited."""
    folder = tmp_path / "ckpt"
    shutil.copytree(good_folder, folder)
    if edit is not None:
        f = folder / "model.safetensors"
        tensors = load_file(f)
        edit(tensors)
        save_file(tensors, f)
    if config_edit is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config_edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_import_does_not_import_torch():
    code = "import jaxpaged, sys; jaxpaged.LLM; jaxpaged.load_model; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_transformers_torch_advice_is_dropped():
    """Without torch (a plain install: torch is only the tests' oracle) transformers logs at
    import that "Models won't be available"; after ``import jaxpaged`` that line is gone."""
    hide_torch = "import sys; sys.modules['torch'] = None; "  # transformers then finds no torch
    advice = "Models won't be available"
    alone = subprocess.run([sys.executable, "-c", hide_torch + "import transformers"],
                           capture_output=True, text=True, check=True)
    assert advice in alone.stderr  # the control: transformers does say it
    ours = subprocess.run([sys.executable, "-c", hide_torch + "import jaxpaged, transformers; "
                           "from transformers import PreTrainedTokenizerFast"],
                          capture_output=True, text=True, check=True)
    assert advice not in ours.stderr, ours.stderr


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_tensor(good_folder, tmp_path):
    folder = variant(good_folder, tmp_path, edit=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.\{1\}\.mlp\.up_proj\.weight") as e:
        load_model(folder)
    assert str(folder) in str(e.value)


def test_extra_tensor(good_folder, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)

    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(variant(good_folder, tmp_path, edit=edit))


def test_misshaped_tensor(good_folder, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 127), np.float32)

    with pytest.raises(CheckpointError, match=r"down_proj\.weight' has shape \(64, 127\), expected \(64, 128\)"):
        load_model(variant(good_folder, tmp_path, edit=edit))


def test_all_problems_reported_at_once(good_folder, tmp_path):
    def edit(t):
        t.pop("model.norm.weight")
        t["model.layers.0.mlp.gate_proj.weight"] = np.zeros((3, 3), np.float32)

    with pytest.raises(CheckpointError) as e:
        load_model(variant(good_folder, tmp_path, edit=edit))
    assert "model.norm.weight" in str(e.value) and "gate_proj" in str(e.value)


def test_unknown_architecture(good_folder, tmp_path):
    def cfg(c):
        c["model_type"], c["architectures"] = "gpt2", ["GPT2LMHeadModel"]

    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        load_model(variant(good_folder, tmp_path, config_edit=cfg))


def test_corrupt_safetensors(good_folder, tmp_path):
    folder = variant(good_folder, tmp_path)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt or truncated"):
        load_model(folder)
    f.write_bytes(b"\x00" * 64)  # garbage header
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(folder)


def test_sharded_checkpoint_loads(good_folder, tmp_path):
    folder = variant(good_folder, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = load_model(good_folder), load_model(folder)
    from flax import nnx
    import jax

    for x, y in zip(jax.tree.leaves(nnx.state(a.model)), jax.tree.leaves(nnx.state(b.model))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(folder)


def test_stale_or_corrupt_cache_is_rebuilt(tmp_path):
    """The Orbax cache of a GGUF: corrupt it and the next load rebuilds it; edit the source and
    the key changes."""
    from jaxpaged.loader import cache_path_for
    from test_gguf import tiny_hf_tensors, write_tiny_gguf

    gguf = tmp_path / "model.gguf"
    write_tiny_gguf(gguf, tiny_hf_tensors())
    first = load_model(gguf, cache_dir=tmp_path / "cache")
    cache = cache_path_for(gguf, tmp_path / "cache")
    for f in (cache / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"garbage")
    again = load_model(gguf, cache_dir=tmp_path / "cache")  # warns, rebuilds
    np.testing.assert_array_equal(np.asarray(first.model.embed[...]), np.asarray(again.model.embed[...]))
    assert (cache / "meta.json").is_file()
    os.utime(gguf, ns=(0, 0))  # the source changed: a new key, a new cache folder
    assert cache_path_for(gguf, tmp_path / "cache") != cache


def test_cache_appears_complete_and_the_first_writer_wins(tmp_path):
    """Two processes converting the same GGUF at once (test workers, a server beside a script):
    each writes beside the cache and renames it into place, so a reader never sees a partial
    one; a writer that finds a complete cache there drops its own copy; a partial folder left
    by an older version is replaced; temporary folders of killed writers are swept, those of
    live ones left alone."""
    from jaxpaged.loader import _save_cache, cache_path_for
    from test_gguf import tiny_hf_tensors, write_tiny_gguf

    gguf = tmp_path / "model.gguf"
    write_tiny_gguf(gguf, tiny_hf_tensors())
    cache = cache_path_for(gguf, tmp_path / "cache")
    cache.mkdir(parents=True)
    (cache / "params").mkdir()  # partial: no meta.json
    first = load_model(gguf, cache_dir=tmp_path / "cache")
    assert (cache / "meta.json").is_file()
    stamp = (cache / "meta.json").stat().st_mtime_ns
    stale, busy = (cache.parent / f"{cache.name}.tmp-{name}" for name in ("killed", "writing"))
    for folder in (stale, busy):
        folder.mkdir()
    os.utime(stale, (0, 0))  # a writer killed long ago; ``busy`` is another writer's, now
    params = {"embed": np.ones((2, 3), np.float32)}  # a second writer's (different) copy
    _save_cache(cache, {}, params, first.tokenizer)
    assert (cache / "meta.json").stat().st_mtime_ns == stamp  # the first writer's cache stays
    assert sorted(p.name for p in cache.parent.iterdir()) == sorted([cache.name, busy.name])
    again = load_model(gguf, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(np.asarray(first.model.embed[...]), np.asarray(again.model.embed[...]))


@pytest.mark.parametrize("kind", ["missing", "truncated", "garbage"])
def test_cli_bad_model_is_one_line_error(tmp_path, kind):
    from jaxpaged.default_model import default_model_path

    bad = tmp_path / "bad.gguf"
    if kind == "truncated":
        bad.write_bytes(default_model_path().read_bytes()[:200_000])
    elif kind == "garbage":
        bad.write_bytes(np.random.default_rng(0).bytes(4096))
    r = subprocess.run([sys.executable, "-m", "jaxpaged", "--model", str(bad), "--no-progress", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0], r.stderr


def write_random_bf16_llama(folder, *, hidden=1024, layers=16, vocab=32000, intermediate=3584, heads=16,
                            shard_bytes=300_000_000):
    """A random Llama saved as bf16 safetensors shards with an index, as ``save_pretrained``
    lays it out, written straight from numpy (seconds, where building it in torch takes a
    minute). Returns (parameter bytes, largest shard's bytes)."""
    import ml_dtypes

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
               intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=heads, vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0,
               max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(cfg))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (hidden, hidden),
                   p + "self_attn.k_proj.weight": (hidden, hidden), p + "self_attn.v_proj.weight": (hidden, hidden),
                   p + "self_attn.o_proj.weight": (hidden, hidden), p + "post_attention_layernorm.weight": (hidden,),
                   p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                   p + "mlp.down_proj.weight": (hidden, intermediate)}
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    nbytes = {n: 2 * int(np.prod(s)) for n, s in shapes.items()}
    shards, size = [[]], 0
    for n in shapes:
        if shards[-1] and size + nbytes[n] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    noise = (np.random.default_rng(0).standard_normal(1 << 20, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    weight_map = {}
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        # Each tensor a different rotation of the noise, so a misplaced tensor shows.
        save_file({n: np.resize(np.roll(noise, j), nbytes[n] // 2).reshape(shapes[n])
                   for j, n in enumerate(names, start=len(weight_map))}, folder / fname)
        weight_map |= dict.fromkeys(names, fname)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(nbytes.values()), max(f.stat().st_size for f in folder.glob("*.safetensors"))


PEAK_RSS_CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from safetensors import safe_open
from jaxpaged.loader import load_model

def status(key):  # bytes
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

base = status("VmRSS")
lm = load_model(sys.argv[1], dtype=jnp.bfloat16, use_cache=False)
jax.block_until_ready(jax.tree.leaves(lm.model))
peak = status("VmHWM")
with safe_open(sys.argv[1] + "/model-00001-of-00003.safetensors", "numpy") as f:
    q = f.get_tensor("model.layers.3.self_attn.q_proj.weight")
    ok = bool(np.array_equal(np.asarray(lm.model.layers.wq[...][3]).reshape(q.shape[1], -1), q.T))
print(json.dumps({"base": base, "peak": peak, "dtype": str(lm.model.embed[...].dtype), "ok": ok}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bf16_sharded_load_peak_host_memory_is_params_plus_one_shard(tmp_path):
    """A 309M-parameter bf16 Llama in 3 shards loads with peak host RSS above the imports within
    the parameter bytes plus one shard: no float32 copy, no second copy of the model. On
    CPU the device memory is host memory, so the params themselves count."""
    param_bytes, shard_bytes = write_random_bf16_llama(tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    r = subprocess.run([sys.executable, "-c", PEAK_RSS_CHILD, str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env=production_env(JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["dtype"] == "bfloat16" and got["ok"]
    above = got["peak"] - got["base"]
    mib = 2**20
    print(f"peak RSS above imports {above / mib:.0f} MiB for {param_bytes / mib:.0f} MiB of params "
          f"(largest shard {shard_bytes / mib:.0f} MiB)")
    assert above <= param_bytes + shard_bytes, (above / mib, param_bytes / mib, shard_bytes / mib)
