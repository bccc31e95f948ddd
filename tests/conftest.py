import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# The suite runs on 2 shared vCPUs whose speed moves by up to ~1.5x within an hour: no property
# test fails for being slow (hypothesis' per-example deadline and its too-slow health check time
# the machine, not the code). Settings a test gives override these.
settings.register_profile("jaxpaged", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("jaxpaged")

# Keep XLA:CPU from grabbing every core per test process and from preallocating.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# XLA:CPU's code generation, quick: LLVM without optimization, each program's kernels in one
# LLVM module instead of modules split for parallel code generation, and the older fusion
# emitters. The suite compiles hundreds of programs, and on 2 vCPUs each took ~1.1 s, 0.35 s
# with these flags (12 step shapes of the tiny engine model: 13.2 -> 4.0 s; one module: six
# engine test files at -n 2 from an empty cache 297 -> 280 and 298 -> 264 s); the same HLO, run by
# slower machine code (the 1,000-request traffic test on the 49152-token tiny model:
# compilation 222 -> 63 s, the rest 87 -> 170 s, most of it the sampler's scalar loops over
# the vocabulary; the longest tiny-model tests now use ``small_vocab_engine_model``).
# ``test_default_model.py::test_production_codegen_gives_the_same_tokens`` runs the default
# model with XLA's defaults beside them, and children that measure what users get run with
# XLA's defaults (``production_env``). JAXPAGED_TEST_CODEGEN=full keeps XLA's defaults
# everywhere; processes with a GPU or TPU plugin installed keep them too.
def _quick_codegen_flags() -> str:
    import importlib.metadata

    flags = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
    try:
        version = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:3])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return flags
    # From jaxlib 0.11.1 XLA:CPU no longer knows the flag that turned its fusion emitters off,
    # and an unknown flag aborts the process (every worker, before a test runs).
    return flags if version >= (0, 11, 1) else f"{flags} --xla_cpu_use_fusion_emitters=false"


QUICK_CODEGEN = _quick_codegen_flags()


def _quick_codegen() -> bool:
    import importlib.util

    accelerator = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))
    return os.environ.get("JAXPAGED_TEST_CODEGEN", "quick") == "quick" and not accelerator


if _quick_codegen() and QUICK_CODEGEN not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_CODEGEN}".strip()


def production_env(**extra) -> dict:
    """This process's environment for a child that must run XLA's own code generation (what
    users run: a memory or token measurement), with ``extra`` set."""
    quick = QUICK_CODEGEN.split()
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in quick)
    env = dict(os.environ, XLA_FLAGS=flags, JAXPAGED_TEST_CODEGEN="full")
    env.update(extra)
    return env


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
            max_position_embeddings=256)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Drop jax's compiled executables after each test module. Each XLA:CPU executable holds
    ~50-100 memory mappings; a whole suite's worth passes the kernel's limit (vm.max_map_count,
    65,530 here) and the next compilation aborts the process."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


@pytest.fixture
def fresh_traces():
    """For tests that switch a setting read while tracing (a module constant, a monkeypatched
    helper): a trace cached for the same shapes would hide it. None from before, none left after."""
    import jax

    jax.clear_caches()
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.long`` tests run first.

    ``@pytest.mark.cpu_host`` tests assert what a CPU-only process does (its interpreted
    kernels, its compiled programs, its default dtype); a GPU or TPU process does otherwise.
    Skipped there before any fixture is set up."""
    import jax

    # Under pytest-xdist (the README's ``-n 2``) a worker runs its share in order: the long
    # tests go first, so that none is left running alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if jax.default_backend() == "cpu":
        return
    skip = pytest.mark.skip(reason=f"asserts what a CPU-only process does; JAX's default backend here is "
                                   f"{jax.default_backend()}")
    for item in items:
        if item.get_closest_marker("cpu_host") is not None:
            item.add_marker(skip)


def make_tiny_hf(folder, *, tie: bool, llama3: bool, seed: int = 0):
    """A random Llama saved with save_pretrained; returns the torch model (float32, eval)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**TINY, tie_word_embeddings=tie, rope_scaling=LLAMA3_SCALING if llama3 else None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to ones; randomise them so they are really tested
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def make_tiny_tp_hf(folder, *, tie: bool = False, seed: int = 0):
    """A random Llama whose 8 query heads, 4 KV heads, MLP width and vocabulary split over
    1, 2 or 4 devices; initialised wide (std 0.2) so greedy tokens are far from ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=16, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=tie, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


QWEN_SHAPES = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                   rope_theta=10000.0, initializer_range=0.2)


def make_tiny_qwen(folder, arch: str, *, tie: bool, seed: int = 0):
    """A random Qwen2 or Qwen3 saved with save_pretrained; its norms and biases randomised (HF
    initialises them to ones and zeros, which would leave them untested). Returns the torch model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    model = model_cls(config(**QWEN_SHAPES, tie_word_embeddings=tie)).eval()
    _randomise_norms_and_biases(model)
    model.save_pretrained(folder)
    return model


def _randomise_norms_and_biases(model) -> None:
    """HF initialises norms to ones and biases to zeros, which would leave them untested."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))


# Mixtral (4 experts, 2 a token), Qwen2-MoE (8 experts, 2 a token, a shared expert, tied) and
# Qwen3-MoE (8 experts, 3 a token, renormalised): the same attention as QWEN_SHAPES.
MOE_ARCHS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False, tie_word_embeddings=True),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
}


def make_tiny_moe(folder, arch: str, *, seed: int = 0):
    """A random mixture-of-experts model (:data:`MOE_ARCHS`) saved with save_pretrained, its norms
    and biases randomised as :func:`make_tiny_qwen`'s. Returns the torch model."""
    import torch
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    config, model_cls = {"mixtral": (MixtralConfig, MixtralForCausalLM),
                         "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
                         "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[arch]
    shapes = {k: v for k, v in QWEN_SHAPES.items() if k != "intermediate_size"}
    model = model_cls(config(**shapes, **MOE_ARCHS[arch])).eval()
    _randomise_norms_and_biases(model)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session", params=[(t, r) for t in (True, False) for r in (False, True)],
                ids=["tied-default", "tied-llama3", "untied-default", "untied-llama3"])
def tiny_hf(request, tmp_path_factory):
    tie, llama3 = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{request.param_index}")
    return folder, make_tiny_hf(folder, tie=tie, llama3=llama3)


@pytest.fixture(scope="session")
def smollm_first_load(tmp_path_factory):
    """The default model loaded once per session through a fresh Orbax cache: (LoadedModel, seconds, cache dir)."""
    import time

    from jaxpaged.loader import load_model

    cache = tmp_path_factory.mktemp("jaxpaged-cache")
    t = time.perf_counter()
    lm = load_model(cache_dir=cache, attention_backend="reference")
    return lm, time.perf_counter() - t, cache


@pytest.fixture(scope="session")
def smollm(smollm_first_load):
    return smollm_first_load[0]


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own GGUF loader on the same file, float32: (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpaged.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tok


def make_tiny_engine_folder(folder, *, vocab_size: int = 49152):
    """A random Llama with SmolLM2's real tokenizer, so text, chat templates, stop strings and
    detokenization work at a fraction of the real model's cost. A ``vocab_size`` below the
    tokenizer's 49152 serves prompts whose ids stay below it (random ids drawn under it, and
    ``traffic.WORDS``, whose ids are below 20480)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxpaged.default_model import default_model_path
    from jaxpaged.gguf_loader import tokenizer_from_gguf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer_from_gguf(default_model_path()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_engine_folder(tmp_path_factory):
    return make_tiny_engine_folder(tmp_path_factory.mktemp("tiny-engine"))


@pytest.fixture(scope="session")
def tiny_engine_model(tiny_engine_folder):
    from jaxpaged.loader import load_model

    return load_model(tiny_engine_folder, attention_backend="xla")


@pytest.fixture(scope="session")
def think_engine_model(tmp_path_factory):
    """The tiny engine model whose tokenizer also holds a reasoning model's ``<think>`` and
    ``</think>`` (added tokens, not special ones, as DeepSeek-R1's are)."""
    from transformers import AutoTokenizer

    from jaxpaged.loader import load_model

    folder = make_tiny_engine_folder(tmp_path_factory.mktemp("tiny-think"), vocab_size=49160)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(folder)
    return load_model(folder, attention_backend="xla")


@pytest.fixture(scope="session")
def small_vocab_engine_folder(tmp_path_factory):
    return make_tiny_engine_folder(tmp_path_factory.mktemp("tiny-engine-20k"), vocab_size=20480)


@pytest.fixture(scope="session")
def small_vocab_engine_model(small_vocab_engine_folder):
    """The tiny engine model with a 20480-token vocabulary, for the tests that run it longest
    with random prompt ids: the sampler's work (under the suite's quick code generation, most
    of a step: Gumbel noise, logprobs) and the logits shrink 2.4x."""
    from jaxpaged.loader import load_model

    return load_model(small_vocab_engine_folder, attention_backend="xla")
