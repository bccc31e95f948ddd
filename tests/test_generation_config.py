"""A model's generation_config.json as the default sampling parameters (vLLM's
``--generation-config``): the offline API, the server, and the refusals."""

import json
import shutil

import httpx
import pytest
from test_server import AUTH, ENGINE, Running

from jaxpaged import LLM, SamplingParams
from jaxpaged.cli import build_parser, engine_kwargs

CONFIG = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5, "do_sample": True, "bos_token_id": 1}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def folder(tiny_engine_folder, tmp_path_factory):
    """The tiny model with a generation config (greedy, at most 5 new tokens)."""
    path = tmp_path_factory.mktemp("with-generation-config") / "model"
    shutil.copytree(tiny_engine_folder, path)
    (path / "generation_config.json").write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), **ENGINE)


def test_the_models_generation_config_is_the_default_sampling(llm, folder, tiny_engine_folder):
    want = SamplingParams(temperature=0.0, top_p=0.9, top_k=20, max_tokens=5)
    assert llm.get_default_sampling_params() == want  # (bos_token_id and do_sample: not sampling fields)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    assert out.token_ids == llm.generate(PROMPT, want, use_tqdm=False)[0].outputs[0].token_ids
    ours = LLM(str(folder), **ENGINE, generation_config="vllm")
    assert ours.get_default_sampling_params() == SamplingParams()
    other = LLM(str(tiny_engine_folder), **ENGINE, generation_config=str(folder))  # another folder's file
    assert other.get_default_sampling_params() == want
    assert LLM(str(tiny_engine_folder), **ENGINE).get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("config, error, match", [
    ({"temperature": -1.0}, ValueError, r"generation_config: .*generation_config.json: temperature must be"),
    ("{not json", ValueError, r"generation_config: .*generation_config.json could not be read"),
])
def test_a_bad_generation_config_is_refused_before_loading(tiny_engine_folder, tmp_path, config, error, match):
    path = tmp_path / "model"
    shutil.copytree(tiny_engine_folder, path)
    (path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(error, match=match):
        LLM(str(path), **ENGINE)
    assert LLM(str(path), **ENGINE, generation_config="vllm").get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("value, error, match", [
    ("/nonexistent/folder", FileNotFoundError, "generation_config: no generation_config.json in /nonexistent"),
    (3, TypeError, "generation_config must be 'auto', 'vllm' or a folder"),
])
def test_a_generation_config_that_is_not_there_is_refused(tiny_engine_folder, value, error, match):
    with pytest.raises(error, match=match):
        LLM(str(tiny_engine_folder), **ENGINE, generation_config=value)


def test_the_server_fills_what_a_request_leaves_unset(llm):
    """Unset fields take the generation config's values; its max_new_tokens caps max_tokens."""
    srv = Running(llm)
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as h:
            def completion(**body):
                r = h.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

            greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
            assert completion(max_tokens=None) == (greedy, 5)  # greedy and 5 tokens: the config's
            assert completion()[1] == 16 and completion(max_tokens=3)[1] == 3  # what a request asks for wins
            sampled = completion(temperature=1.0, seed=7, top_k=-1, top_p=1.0)
            assert sampled == completion(temperature=1.0, seed=7, top_k=-1, top_p=1.0)
            chat = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "ignore_eos": True}).json()
            assert chat["usage"]["completion_tokens"] == 5 and chat["choices"][0]["finish_reason"] == "length"
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def roomy_default(tiny_engine_folder, tmp_path_factory):
    """A model whose generation config samples (temperature 0.6, top_p 0.9) and allows more new
    tokens than its 64-token window holds."""
    path = tmp_path_factory.mktemp("long-default") / "model"
    shutil.copytree(tiny_engine_folder, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9,
                                                             "max_new_tokens": 10 ** 6}))
    return path


def test_a_default_max_tokens_is_cut_to_what_fits_and_beams_take_only_it(roomy_default):
    llm = LLM(str(roomy_default), **{**ENGINE, "max_model_len": 64})
    srv = Running(llm)
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as h:
            messages = [{"role": "user", "content": "Say something."}]
            r = h.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True}).json()
            u = r["usage"]
            assert u["prompt_tokens"] + u["completion_tokens"] == 64  # the default, cut to the window: no 400
            r = h.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 60})
            assert r.status_code == 400 and "max_tokens is too large: 60" in r.json()["error"]["message"]
            beam = h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True,
                                                   "n": 2})  # temperature 0 (deterministic), top_p 0.9 not taken
            assert beam.status_code == 200 and len(beam.json()["choices"]) == 2, beam.text
    finally:
        srv.stop()


def test_generate_checks_its_options_against_the_models_defaults(folder, monkeypatch):
    import jaxpaged
    import jaxpaged.engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the options were not checked before loading")

    monkeypatch.setattr(jaxpaged.engine, "LLM", no_loading)
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens=5"):  # the config's 5
        jaxpaged.generate(PROMPT, model=str(folder), min_tokens=10)


def test_the_command_line_takes_a_generation_config(folder, capsys):
    from jaxpaged.cli import main

    p = build_parser()
    assert engine_kwargs(p.parse_args([]))["generation_config"] == "auto"
    assert engine_kwargs(p.parse_args(["--generation-config", "vllm"]))["generation_config"] == "vllm"
    counts = []
    for extra in ([], ["--generation-config", "vllm", "--max-tokens", "9"]):
        assert main(["--model", str(folder), "--json", "--ignore-eos", "--no-progress", *extra, PROMPT]) == 0
        counts.append(len(json.loads(capsys.readouterr().out.splitlines()[0])["outputs"][0]["token_ids"]))
    assert counts == [5, 9]  # the config's max_new_tokens, then jaxpaged's own defaults


def test_a_file_is_read_once_per_version(folder, tmp_path, caplog):
    """``jaxpaged.generate`` and the CLI check the config before the engine they make reads it:
    one read (one log line) per version of the file; a changed file is read again."""
    from jaxpaged.generation_config import default_sampling_overrides

    path = tmp_path / "model"
    shutil.copytree(folder, path)
    with caplog.at_level("INFO", logger="jaxpaged.generation_config"):
        first = default_sampling_overrides("auto", path)
        first["max_tokens"] = 99  # the caller's copy
        assert default_sampling_overrides("auto", path) == {"temperature": 0.0, "top_p": 0.9, "top_k": 20,
                                                             "max_tokens": 5}
        (path / "generation_config.json").write_text(json.dumps({**CONFIG, "max_new_tokens": 17}))
        assert default_sampling_overrides("auto", path)["max_tokens"] == 17
    assert len([r for r in caplog.records if "default sampling parameters from" in r.getMessage()]) == 2
