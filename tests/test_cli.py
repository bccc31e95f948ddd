"""The CLI, run in-process on the tiny model (the real model's run is in test_engine_hf.py)."""

import io
import json

import pytest

from jaxpaged.cli import main


def run(capsys, monkeypatch, argv, stdin=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_prompts_from_args_json(capsys, monkeypatch, tiny_engine_folder):
    code, out, err = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), "--json", "--max-tokens", "5",
                                               "--ignore-eos", "Hello there", "How are you?"])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [d["prompt"] for d in lines[:2]] == ["Hello there", "How are you?"]
    assert all(len(d["outputs"][0]["token_ids"]) == 5 for d in lines[:2])
    s = lines[2]["summary"]
    assert s["requests"] == 2 and s["generated_tokens"] == 10 and s["compiled_shapes"] >= 1
    assert "logprobs" not in lines[0]["outputs"][0] and "prompt_logprobs" not in lines[0]


def test_json_carries_logprobs(capsys, monkeypatch, tiny_engine_folder):
    code, out, err = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), "--json", "--max-tokens", "3",
                                               "--ignore-eos", "--logprobs", "2", "--prompt-logprobs", "1",
                                               "--temperature", "0", "Hello there"])
    assert code == 0, err
    d = json.loads(out.splitlines()[0])
    c = d["outputs"][0]
    assert len(c["logprobs"]) == 3
    for tid, pos in zip(c["token_ids"], c["logprobs"]):
        assert pos[0]["token_id"] == tid and pos[0]["rank"] == 1  # greedy: the chosen token is the top one
        assert len(pos) == 2 and pos[0]["logprob"] >= pos[1]["logprob"] and isinstance(pos[0]["token"], str)
    assert sum(pos[0]["logprob"] for pos in c["logprobs"]) == pytest.approx(c["cumulative_logprob"], rel=1e-5)
    assert len(d["prompt_logprobs"]) == d["num_prompt_tokens"] and d["prompt_logprobs"][0] is None


def test_prompts_from_jsonl_with_per_line_options(capsys, monkeypatch, tmp_path, tiny_engine_folder):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "one", "max_tokens": 3}\n\n{"prompt": "two", "max_tokens": 7, "n": 2, '
                 '"temperature": 1.0, "seed": 3}\n')
    code, out, _ = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), "--file", str(f), "--json",
                                             "--ignore-eos"])
    assert code == 0
    a, b = (json.loads(line) for line in out.splitlines()[:2])
    assert len(a["outputs"][0]["token_ids"]) == 3
    assert [len(c["token_ids"]) for c in b["outputs"]] == [7, 7]


def test_jsonl_priorities_need_the_priority_policy(capsys, monkeypatch, tmp_path, tiny_engine_folder):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "one", "priority": 2}\n{"prompt": "two", "priority": -1}\n')
    argv = ["--model", str(tiny_engine_folder), "--file", str(f), "--json", "--max-tokens", "3", "--ignore-eos",
            "--max-num-seqs", "1", "--no-async-scheduling"]
    code, _, err = run(capsys, monkeypatch, argv)
    assert code == 1 and f"{f}:1: priority 2 needs --scheduling-policy priority" in err
    code, out, _ = run(capsys, monkeypatch, [*argv, "--scheduling-policy", "priority"])
    assert code == 0
    a, b = (json.loads(line) for line in out.splitlines()[:2])  # in input order
    assert (a["prompt"], b["prompt"]) == ("one", "two")
    assert [len(c["outputs"][0]["token_ids"]) for c in (a, b)] == [3, 3]
    f.write_text('{"prompt": "one", "priority": "high"}\n')
    code, _, err = run(capsys, monkeypatch, [*argv, "--scheduling-policy", "priority"])
    assert code == 1 and f"{f}:1: priority must be an int, got 'high'" in err


def test_prompts_from_stdin_and_text_summary(capsys, monkeypatch, tiny_engine_folder):
    code, out, err = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), "--max-tokens", "4",
                                               "--no-progress"], stdin="first prompt\nsecond prompt\n")
    assert code == 0
    assert "2 requests" in err and "tok/s" in err and "TTFT p50" in err and "prefix hit rate" in err
    assert out.count("-" * 40) == 2


def test_stream(capsys, monkeypatch, tiny_engine_folder):
    code, out, _ = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), "--stream", "--max-tokens", "6",
                                             "--ignore-eos", "--chat", "Hi"])
    assert code == 0 and out.strip()


def test_stream_checks_every_prompt_first(capsys, monkeypatch, tiny_engine_folder):
    argv = ["--model", str(tiny_engine_folder), "--stream", "--max-tokens", "6", "--max-model-len", "64"]
    code, out, err = run(capsys, monkeypatch, argv + ["Hi", "word " * 100])
    assert code == 1 and out == ""  # nothing streamed before the bad prompt was found
    assert "prompt 2 has 101 tokens" in err and "max_model_len is 64" in err
    code, out, err = run(capsys, monkeypatch, argv + ["--n", "2", "--temperature", "1", "Hi"])
    assert code == 1 and out == "" and "--stream prints one completion a prompt; prompt 1 asks for n=2" in err
    with pytest.raises(SystemExit):
        main(argv + ["--json", "Hi"])
    assert "give one" in capsys.readouterr().err


def test_stdin_dash_beside_prompts_and_option_errors_name_the_line(capsys, monkeypatch, tmp_path,
                                                                     tiny_engine_folder):
    argv = ["--model", str(tiny_engine_folder), "--json", "--max-tokens", "2"]
    code, out, _ = run(capsys, monkeypatch, argv + ["x", "-"], stdin="a\nb\n")
    assert code == 0 and [json.loads(line)["prompt"] for line in out.splitlines()[:3]] == ["x", "a", "b"]
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "two", "max_tokens": -1}\n')
    code, _, err = run(capsys, monkeypatch, argv + ["--file", str(f)])
    assert code == 1 and f"{f}:2: max_tokens" in err
    with pytest.raises(SystemExit):
        main(argv + ["--system", "be brief", "x"])
    assert "--system is a chat option: add --chat" in capsys.readouterr().err


def test_chat_template_from_a_file_or_the_command_line(capsys, monkeypatch, tmp_path, tiny_engine_folder):
    argv = ["--model", str(tiny_engine_folder), "--json", "--max-tokens", "1", "--chat"]
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_engine_folder)
    for template, prompt in [(str(f), "<system>Be brief.<user>hey"), (r"{{ messages[-1].content }}\n!", "hey\n!"),
                             ("é{{ messages[-1].content }}", "éhey")]:
        code, out, err = run(capsys, monkeypatch, argv + ["--system", "Be brief.", "--chat-template", template, "hey"])
        assert code == 0, err
        assert json.loads(out.splitlines()[0])["num_prompt_tokens"] == len(tok(prompt, add_special_tokens=False)[
            "input_ids"])
    for bad, match in [("/nonexistent/t.jinja", "no such file, and it is not a template"),
                       ("{% for %}", "--chat-template is not a valid Jinja template")]:
        with pytest.raises(SystemExit):
            main(argv + ["--chat-template", bad, "x"])
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv[:-1] + ["--chat-template", str(f), "x"])
    assert "--chat-template is a chat option: add --chat" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--temperature", "-1", "x"], "temperature"),
    (["--block-size", "3", "x"], "block_size=3 must be a power of two"),
    (["--file", "/nonexistent/prompts.txt"], "/nonexistent/prompts.txt"),
    (["--kv-cache-memory", "huge", "x"], "kv_cache_memory='huge'"),
    (["--regex", "a(b", "x"], "structured_outputs.regex is not a valid constraint"),
    (["--json-schema", "@/nonexistent/schema.json", "x"], "--json-schema: file not found: /nonexistent/schema.json"),
])
def test_bad_input_one_line_error(capsys, monkeypatch, tiny_engine_folder, argv, match):
    code, _, err = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), *argv])
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and match in err


def test_bad_jsonl_line(capsys, monkeypatch, tmp_path, tiny_engine_folder):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{not json}\n')
    code, _, err = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), "--file", str(f)])
    assert code == 1 and f"{f}:2" in err


def test_structured_output_flags(capsys, monkeypatch, tmp_path, tiny_engine_folder):
    schema = tmp_path / "schema.json"
    schema.write_text('{"enum": ["up", "down"]}')
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b", "structured_outputs": {"json": {"enum": [7, 8]}}}\n')
    for flags, ok in [(["--regex", "[a-c]{4}"], lambda t: len(t) == 4 and set(t) <= set("abc")),
                      (["--choice", "left", "--choice", "right"], lambda t: t in ("left", "right")),
                      (["--json-schema", f"@{schema}"], lambda t: json.loads(t) in ("up", "down"))]:
        code, out, err = run(capsys, monkeypatch, ["--model", str(tiny_engine_folder), "--json", "--max-tokens", "40",
                                                   "--temperature", "0.8", "--seed", "1", *flags, "--file", str(f)])
        assert code == 0, err
        a, b = (json.loads(line)["outputs"][0]["text"] for line in out.splitlines()[:2])
        assert ok(a), (flags, a)
        assert json.loads(b) in (7, 8)  # the line's own structured output wins over the flags
