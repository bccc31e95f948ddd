"""LoRA adapters (jaxpaged.lora) against PEFT's LoRA on Hugging Face's PyTorch Llama, float32:
the model in its three forms with several adapters in one step, the engine's greedy tokens with
more adapters than device slots, random traffic under memory pressure, and what is refused."""

import copy
import json
import shutil

import jax
import numpy as np
import pytest
import torch
from conftest import make_tiny_tp_hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged import step_metadata

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.kv_cache import init_kv_pool
from jaxpaged.loader import load_model
from jaxpaged.lora import LoRAConfig, LoRAManager, LoRASlots

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# PEFT LoraConfig options of each test adapter: every module; q and v of the last layer only, rsLoRA's
# scale; the MLP at the engine's most rank.
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=ALL),
            "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True,
                        layers_to_transform=[1]),
            "mlp16": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])}
MAX_RANK = 16
BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(loaded base model, HF base, {name: PEFT model}, {name: LoRARequest}); each adapter's A and B
    random (PEFT would start B at zero), saved with ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = make_tiny_tp_hf(tmp_path_factory.mktemp("lora-base"))
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft_models, requests = {}, {}
    for i, (name, options) in enumerate(ADAPTERS.items(), 1):
        torch.manual_seed(i)
        pm = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **options)).eval()
        folder = tmp_path_factory.mktemp(name)
        pm.save_pretrained(folder)
        peft_models[name], requests[name] = pm, LoRARequest(name, i, str(folder))
    return load_model(base, dtype=np.float32), hf, peft_models, requests


def oracle(models, name, prompt, max_tokens, cache={}):
    """Greedy tokens of PEFT's model ``name`` (None: the base model)."""
    key = (id(models), name, tuple(prompt), max_tokens)
    if key not in cache:
        m = models[name]
        with torch.no_grad():
            out = m.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False)
        cache[key] = out[0, len(prompt):].tolist()
    return cache[key]


def with_base(lora_setup):
    _, hf, peft_models, _ = lora_setup
    return {None: hf, **peft_models}


@pytest.mark.parametrize("form", ["stacked", "in_out", "out_in"])
def test_three_adapters_and_the_base_in_one_step_match_peft(lora_setup, form):
    """Four sequences, each its own adapter's slot (one the base model's), prefilled in one step
    and decoded a token a step, in the stacked form (GPU, TPU, tensor parallelism) and the CPU
    form in both weight layouts; the logits against PEFT's."""
    lm, hf, peft_models, requests = lora_setup
    model = lm.model if form == "stacked" else lm.model.unstacked(form)
    cfg = lm.config
    manager = LoRAManager(cfg, LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK))
    slots = LoRASlots(cfg, manager.config, np.float32, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    names = ["mlp16", None, "all8", "qv4"]
    slot_of = slots.slots({requests[n].lora_int_id: manager.get(requests[n]) for n in names if n is not None})
    seq_slot = [-1 if n is None else slot_of[requests[n].lora_int_id] for n in names]
    models = with_base(lora_setup)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (9, 5, 7, 6)]
    per_seq = 6
    kv = init_kv_pool(cfg.num_layers, 1 + per_seq * len(seqs), cfg.num_kv_heads, BS, cfg.head_dim)
    new = [len(s) for s in seqs]
    cached = [0] * len(seqs)
    for step in range(3):
        md = step_metadata(cached, new, block_size=BS, blocks_per_seq=per_seq)
        tokens = np.array(sum((s[c:] for s, c in zip(seqs, cached)), []), np.int32)
        token_slots = np.repeat(seq_slot, new).astype(np.int32)
        ends = np.cumsum(new) - 1
        logits, kv = model(tokens, kv, md, logits_indices=ends, lora=(token_slots, slots.weights))
        for i, (n, s) in enumerate(zip(names, seqs)):
            with torch.no_grad():
                want = models[n](torch.tensor([s])).logits[0, -1].numpy()
            np.testing.assert_allclose(np.asarray(logits[i]), want, atol=1e-4, rtol=0,
                                       err_msg=f"{form}: adapter {n}, step {step}")
        cached = [len(s) for s in seqs]
        for s in seqs:
            s.append(int(rng.integers(0, cfg.vocab_size)))
        new = [1] * len(seqs)
    # The adapters do change the logits (else the comparison above would prove nothing).
    with torch.no_grad():
        base, tuned = (m(torch.tensor([seqs[0]])).logits[0, -1].numpy() for m in (hf, peft_models["mlp16"]))
    assert np.abs(base - tuned).max() > 0.1


def test_engine_serves_more_adapters_than_slots(lora_setup):
    """A prompt computed under one adapter, then under each adapter and the base model beside
    others, with two device slots for three adapters: each request's greedy tokens are PEFT's for
    its adapter; the prefix cache served the first adapter's blocks to it alone; nothing leaks."""
    lm, _, _, requests = lora_setup
    models = with_base(lora_setup)
    llm = LLM(lm, num_blocks=96, block_size=BS, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK,
              debug_checks=True)
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 13).tolist()
    names = ["all8", "qv4", None, "mlp16", "all8", "mlp16", None, "qv4"]
    prompts = [shared if i < 4 else shared[:9] + rng.integers(0, 256, 4).tolist() for i in range(len(names))]
    llm.generate(shared, GREEDY, lora_request=requests["all8"], use_tqdm=False)
    hits = llm.stats()["prefix_cache_hits"]
    outs = llm.generate(prompts, GREEDY, lora_request=[n and requests[n] for n in names], use_tqdm=False)
    for p, n, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == oracle(models, n, p, GREEDY.max_tokens), n
    assert [o.num_cached_tokens for o in outs[:4]] == [12, 0, 0, 0]  # (whole blocks, the last token computed)
    assert llm.stats()["prefix_cache_hits"] > hits
    assert llm.stats()["num_used_blocks"] == 0
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 4


def test_a_waiting_request_of_another_adapter_is_passed_over(lora_setup):
    """vLLM's rule: with every slot taken by running requests' adapters, a waiting request of
    another adapter waits, and the later requests of the running adapters start before it."""
    lm, _, _, requests = lora_setup
    llm = LLM(lm, num_blocks=96, block_size=BS, enable_lora=True, max_loras=1, max_lora_rank=MAX_RANK)
    a, b = requests["all8"], requests["qv4"]
    for i, r in enumerate([a, b, a, b, None]):
        llm.add_request(list(range(10 + i, 20 + i)), GREEDY, lora_request=r)
    llm.step()
    running = llm.scheduler.running
    assert sorted(r.request_id for r in running) == ["0", "2", "4"]
    while llm.has_unfinished_requests():
        for r in llm.scheduler.running:  # never more adapters than slots
            assert len({r.lora.id for r in llm.scheduler.running if r.lora is not None}) <= 1
        llm.step()
    assert llm.stats()["num_used_blocks"] == 0


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traffic_with_adapters_under_memory_pressure(lora_setup, data):
    """Requests of random adapters arriving over the steps of an engine whose pool holds a few
    of them (preemption by recompute or swap, prefix caching, two slots for three adapters):
    every request's greedy tokens are PEFT's for its adapter, and every block comes back."""
    lm, _, _, requests = lora_setup
    models = with_base(lora_setup)
    swap = data.draw(st.booleans(), "swap")
    llm = LLM(lm, num_blocks=14, block_size=BS, max_num_seqs=3, max_num_batched_tokens=16, enable_lora=True,
              max_loras=2, max_lora_rank=MAX_RANK, preemption_mode="swap" if swap else "recompute",
              swap_space=8 * 2 * 2 * 4 * BS * 16 * 4 if swap else 0, debug_checks=True,
              async_scheduling=data.draw(st.booleans(), "async"))
    prefix = list(range(40, 48))
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([None, *ADAPTERS]),
                                            st.integers(1, 14), st.booleans(), st.integers(1, 10)),
                                  min_size=1, max_size=10), "arrivals")
    arrivals.sort(key=lambda a: a[0])
    live, step = {}, 0
    while arrivals or llm.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, name, n, shared, max_tokens = arrivals.pop(0)
            prompt = (prefix if shared else []) + [(7 * n + 3 * j) % 256 for j in range(n)]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            rid = llm.add_request(prompt, params, lora_request=name and requests[name])
            live[rid] = (name, prompt, max_tokens)
        for o in llm.step():
            if o.finished:
                name, prompt, max_tokens = live.pop(o.request_id)
                assert o.outputs[0].token_ids == oracle(models, name, prompt, max_tokens), (name, prompt)
        assert len({r.lora.id for r in llm.scheduler.running if r.lora is not None}) <= 2
        step += 1
        assert step < 500, "livelock"
    assert not live
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_host_blocks_used"] == 0, stats


def test_beam_search_and_the_async_engine_take_the_adapter(lora_setup):
    """``beam_search`` (against PEFT's beam search) and ``AsyncLLM.generate`` (against PEFT's
    greedy tokens) run a request with its adapter, as ``generate`` does."""
    import asyncio

    from jaxpaged import BeamSearchParams
    from jaxpaged.async_engine import AsyncLLM

    lm, _, peft_models, requests = lora_setup
    llm = LLM(lm, num_blocks=96, block_size=BS, enable_lora=True, max_loras=1, max_lora_rank=MAX_RANK)
    a, prompt = requests["all8"], list(range(50, 61))
    [out] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=8,
                                                                             ignore_eos=True), lora_request=a)
    with torch.no_grad():
        want = peft_models["all8"].generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                            num_beams=2, do_sample=False, early_stopping=False,
                                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out.sequences[0].tokens == want[0].tolist()

    async def stream():
        engine = AsyncLLM(llm)
        try:
            return [o async for o in engine.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=a)][-1]
        finally:
            engine.shutdown()

    assert asyncio.run(stream()).outputs[0].token_ids == oracle(with_base(lora_setup), "all8", prompt, 8)


def _copy_adapter(src, dst, **config):
    shutil.copytree(src, dst)
    conf = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**conf, **config}))
    return dst


def test_what_is_refused_is_named_before_anything_runs(lora_setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    lm, _, _, requests = lora_setup
    a = requests["all8"]
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(lm, num_blocks=32, block_size=BS).generate([1, 2, 3], GREEDY, lora_request=a)
    llm = LLM(lm, num_blocks=32, block_size=BS, enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 is more than max_lora_rank=8"):
        llm.add_request([1, 2], GREEDY, lora_request=requests["mlp16"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.add_request([1, 2], GREEDY, lora_request=LoRARequest("x", 7, str(tmp_path / "none")))
    dora = _copy_adapter(a.lora_path, tmp_path / "dora", use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        llm.add_request([1, 2], GREEDY, lora_request=LoRARequest("d", 8, str(dora)))
    saved = _copy_adapter(a.lora_path, tmp_path / "saved", modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="modules_to_save"):
        llm.add_request([1, 2], GREEDY, lora_request=LoRARequest("s", 9, str(saved)))
    ranks = _copy_adapter(a.lora_path, tmp_path / "ranks", rank_pattern={"q_proj": 4})
    with pytest.raises(ValueError, match=r"rank_pattern=\{'q_proj': 4\} \(per-module ranks\) is not supported"):
        llm.add_request([1, 2], GREEDY, lora_request=LoRARequest("r", 30, str(ranks)))
    for name, change in (("head", {"base_model.model.lm_head.lora_A.weight": np.ones((8, 64), np.float32)}),
                         ("shape", {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                    np.ones((8, 32), np.float32)})):
        folder = _copy_adapter(a.lora_path, tmp_path / name)
        tensors = {**load_file(folder / "adapter_model.safetensors"), **change}
        save_file(tensors, folder / "adapter_model.safetensors")
        with pytest.raises(ValueError, match="lm_head.lora_A.*not a LoRA update" if name == "head"
                           else r"layer 0 q_proj: lora_A \(8, 32\)"):
            llm.add_request([1, 2], GREEDY, lora_request=LoRARequest(name, 10 + len(name), str(folder)))
    llm.add_request([1, 2], GREEDY, lora_request=a)
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'all8'"):
        llm.add_request([1, 2], GREEDY, lora_request=LoRARequest("other", 1, str(dora)))
    # An id names one adapter for the engine's life, also once its weights have left the host (max_cpu_loras 1).
    copy_of_a = LoRARequest("copy", 20, str(_copy_adapter(a.lora_path, tmp_path / "copy")))
    assert llm.inputs.lora.get(copy_of_a).id == 20
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'all8'"):
        llm.inputs.lora.get(LoRARequest("other", 1, str(dora)))
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("zero", 0, a.lora_path)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1, 2], [3, 4]], GREEDY, lora_request=[a])
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.generate([[1, 2], [3, 4]], GREEDY, lora_request=[a, "all8"])
    # A bad request among good ones queues none of them; the one queued above still runs.
    assert len(llm.scheduler.waiting) == 1
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate([[1, 2], [3, 4]], GREEDY, lora_request=[a, LoRARequest("d", 8, str(dora))])
    assert len(llm.scheduler.waiting) == 1
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    [out] = done.values()
    assert out.outputs[0].token_ids == oracle(with_base(lora_setup), "all8", [1, 2], GREEDY.max_tokens)
    with pytest.raises(ValueError, match="enable_dp_attention"):
        LLM(lm, enable_lora=True, data_parallel_size=2, enable_dp_attention=True)


def test_the_server_serves_each_adapter_by_name(lora_setup):
    """``lora_modules`` (``--lora-modules``): a request's ``model`` picks its adapter (or the base
    model) in completions and embeddings; the tokens are PEFT's; ``/v1/models`` lists the adapters
    with the base model as their parent; an unknown name is a 404 naming what is served; vLLM's
    load and unload endpoints change the adapters while the server runs."""
    import httpx
    from test_server import AUTH, MODEL, Running

    lm, _, peft_models, requests = lora_setup
    models = with_base(lora_setup)
    served = Running(LLM(lm, num_blocks=96, block_size=BS, enable_lora=True, max_loras=1, max_lora_rank=MAX_RANK),
                     lora_modules=[requests["all8"], requests["mlp16"]], allow_runtime_lora_updating=True)
    prompt = list(range(30, 41))
    try:
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as h:
            listed = h.get("/v1/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in listed] == [(MODEL, None), ("all8", MODEL), ("mlp16", MODEL)]
            assert listed[1]["root"] == requests["all8"].lora_path
            for name in (None, "all8", "mlp16"):
                body = {"model": name or MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}
                r = h.post("/v1/completions", json=body).json()
                assert r["model"] == (name or MODEL)
                assert r["choices"][0]["token_ids"] == oracle(models, name, prompt, 8), name
            missing = h.post("/v1/completions", json={"model": "qv4", "prompt": prompt, "max_tokens": 2})
            assert missing.status_code == 404 and "'tiny-llama', 'all8', 'mlp16'" in missing.json()["error"]["message"]
            emb = h.post("/v1/embeddings", json={"model": "mlp16", "input": [prompt]}).json()
            info = [line for line in h.get("/metrics").text.splitlines() if line.startswith("jaxpaged:lora_requests")]
            assert len(info) == 1 and 'max_lora="1"' in info[0] and 'running_lora_adapters=""' in info[0], info
            # vLLM's runtime updating: an adapter added, one removed (a request naming it is then a 404).
            loaded = h.post("/v1/load_lora_adapter", json={"lora_name": "qv4", "lora_path": requests["qv4"].lora_path})
            assert loaded.status_code == 200, loaded.text
            body = {"model": "qv4", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            assert h.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == oracle(models, "qv4",
                                                                                                     prompt, 8)
            again = h.post("/v1/load_lora_adapter", json={"lora_name": "qv4", "lora_path": "/elsewhere"})
            assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
            bad = h.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such/folder"})
            assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
            assert h.post("/v1/unload_lora_adapter", json={"lora_name": "all8"}).status_code == 200
            assert h.post("/v1/completions", json={**body, "model": "all8"}).status_code == 404
            assert h.post("/v1/unload_lora_adapter", json={"lora_name": "all8"}).status_code == 404
            assert [m["id"] for m in h.get("/v1/models").json()["data"]] == [MODEL, "mlp16", "qv4"]
        with torch.no_grad():
            decoder = peft_models["mlp16"].base_model.model.model
            hidden = decoder(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(emb["data"][0]["embedding"], hidden / np.linalg.norm(hidden), atol=1e-5)
    finally:
        served.stop()


def test_serve_command_line_takes_vllms_lora_module_forms(capsys):
    from jaxpaged.serve import build_parser, run

    args = build_parser().parse_args(["--enable-lora", "--lora-modules", "a=/x/a",
                                      '{"name": "b", "path": "/x/b", "base_model_name": "m"}'])
    assert args.lora_modules == [{"name": "a", "path": "/x/a"}, {"name": "b", "path": "/x/b", "base_model_name": "m"}]
    for argv, message in ((["--lora-modules", "a=/x"], "needs --enable-lora"),
                          (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "a name twice"),
                          (["--enable-lora", "--lora-modules", "/x"], "is not name=path")):
        with pytest.raises(SystemExit):
            run(argv)
        assert message in capsys.readouterr().err


def test_cli_runs_every_prompt_with_its_lora(capsys, tmp_path, tiny_engine_folder):
    """``jaxpaged-generate --lora PATH`` on a model with a tokenizer: PEFT's greedy tokens; ``LLM.stream``
    with the same adapter streams their text; ``LLM.chat`` with it gives PEFT's tokens for the chat prompt."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpaged.cli import main

    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_pretrained(tiny_engine_folder, dtype=torch.float32).eval()
    pm = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                       init_lora_weights=False)).eval()
    pm.save_pretrained(tmp_path / "adapter")
    assert main(["--model", str(tiny_engine_folder), "--lora", str(tmp_path / "adapter"), "--json", "--max-tokens",
                 "6", "--ignore-eos", "--temperature", "0", "--no-progress", "Hello there"]) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[0])["outputs"][0]["token_ids"]
    tok = AutoTokenizer.from_pretrained(tiny_engine_folder)
    ids = tok("Hello there")["input_ids"]
    assert got == oracle({"cli": pm}, "cli", ids, 6)
    # LLM.stream with the adapter: its text is that of the same tokens.
    llm = LLM(str(tiny_engine_folder), enable_lora=True, max_lora_rank=4)
    lora = LoRARequest("cli", 1, str(tmp_path / "adapter"))
    text = "".join(llm.stream("Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              lora_request=lora))
    assert text == tok.decode(got, skip_special_tokens=True)
    conversation = [{"role": "user", "content": "Hello there"}]
    [reply] = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora_request=lora,
                       use_tqdm=False)
    assert reply.outputs[0].token_ids == oracle({"cli": pm}, "cli", llm.apply_chat_template(conversation), 6)
