"""Weight loading: every bad checkpoint raises one clear error naming the file and the tensor."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged.loader import CheckpointError, load_model

from conftest import make_tiny_hf


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
    import os

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
