"""``jaxpaged-generate``: generate from the command line (also ``python -m jaxpaged``).

Prompts come from the arguments, from ``--file`` (one prompt per line, or JSON lines
with a ``"prompt"`` and per-line sampling options) or from standard input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from jaxpaged.chat_template import load_chat_template
from jaxpaged.generation_config import default_sampling_overrides, for_request
from jaxpaged.input_processor import RUNNERS
from jaxpaged.reasoning import REASONING_PARSERS

PROG = "jaxpaged-generate"
_SAMPLING = [  # (flag, type, SamplingParams field)
    ("--max-tokens", int, "max_tokens"), ("--min-tokens", int, "min_tokens"), ("--n", int, "n"),
    ("--temperature", float, "temperature"), ("--top-p", float, "top_p"), ("--top-k", int, "top_k"),
    ("--min-p", float, "min_p"), ("--repetition-penalty", float, "repetition_penalty"),
    ("--presence-penalty", float, "presence_penalty"), ("--frequency-penalty", float, "frequency_penalty"),
    ("--seed", int, "seed"), ("--logprobs", int, "logprobs"), ("--prompt-logprobs", int, "prompt_logprobs"),
    ("--beam-width", int, "beam_width"), ("--length-penalty", float, "length_penalty"),
    ("--cache-salt", str, "cache_salt"),
]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``LLM`` options, shared by ``jaxpaged-generate`` and ``jaxpaged-serve``; see ``engine_kwargs``."""
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weights (default: float32 on CPU, bfloat16 elsewhere); on CPU activations stay float32, "
                        "and bfloat16 speeds up batches where the CPU has AMX or AVX512-BF16")
    e.add_argument("--block-size", type=int, help="tokens per KV block (default: 64 on CPU, 16 on GPU/TPU)")
    e.add_argument("--num-blocks", type=int)
    e.add_argument("--kv-cache-memory", help="KV pool size, e.g. 2GiB")
    e.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV pool dtype (auto: the model's; float32 for a 16-bit model on CPU); fp8 (= fp8_e4m3) "
                        "holds 4x float32's tokens, K/V rounded to it")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    e.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: requests run in order of their priority (lower first), then of arrival, "
                        "and may preempt running ones of a later priority (fcfs refuses a priority other than 0)")
    e.add_argument("--swap-space", default="0", help="host memory for swapped KV blocks, e.g. 1GiB")
    e.add_argument("--attention-backend", choices=["auto", "pallas", "pallas_tpu", "pallas_gpu", "xla", "reference"],
                   default="auto", help="auto: pallas_tpu on TPU, pallas_gpu on GPU, xla on CPU")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model and KV cache over this many devices")
    e.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run this many engine replicas, one per device, and spread the requests over them")
    e.add_argument("--enable-dp-attention", action="store_true",
                   help="on CPU, run the replicas' steps as one program: attention per replica, the MLP and "
                        "LM head split between the devices (needs --data-parallel-size > 1)")
    e.add_argument("--seed-engine", type=int, default=0, dest="engine_seed")
    e.add_argument("--no-async-scheduling", action="store_true",
                   help="schedule each step only after the previous one finished (default: while it runs)")
    e.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: auto (the model folder's generation_config.json, as vLLM), "
                        "vllm (jaxpaged's own), or a folder holding a generation_config.json")
    e.add_argument("--speculative-config", type=_json_object,
                   help='speculative decoding with n-gram drafts, as vLLM: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    e.add_argument("--runner", choices=RUNNERS, default="auto",
                   help="vLLM's: generate (completions only), pooling (embeddings only), auto (both)")
    e.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="a reasoning model's think tags (deepseek_r1, qwen3: <think>...</think>): structured outputs "
                        "start after the reasoning; the server returns it as the reply's reasoning")
    e.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders) beside the model")
    e.add_argument("--max-loras", type=int, default=1, help="most LoRA adapters on the device at once (default 1)")
    e.add_argument("--max-lora-rank", type=int, default=16, help="most rank of a LoRA adapter (default 16)")
    e.add_argument("--max-cpu-loras", type=int, help="most LoRA adapters kept loaded on the host (default "
                                                      "--max-loras)")
    e.add_argument("--enable-sleep-mode", action="store_true",
                   help="vLLM's sleep mode: the server's POST /sleep frees the device memory, POST /wake_up brings "
                        "it back")
    return e


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM``'s keyword arguments (all but the model) from the options of ``add_engine_args``."""
    return dict(dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching, preemption_mode=args.preemption_mode,
                swap_space=args.swap_space if args.swap_space not in ("0", "") else 0,
                attention_backend=args.attention_backend, seed=args.engine_seed,
                tensor_parallel_size=args.tensor_parallel_size, async_scheduling=not args.no_async_scheduling,
                kv_cache_dtype=args.kv_cache_dtype, data_parallel_size=args.data_parallel_size,
                enable_dp_attention=args.enable_dp_attention, speculative_config=args.speculative_config,
                generation_config=args.generation_config, scheduling_policy=args.scheduling_policy,
                reasoning_parser=args.reasoning_parser, runner=args.runner, enable_lora=args.enable_lora,
                max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                enable_sleep_mode=args.enable_sleep_mode)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Generate text with jaxpaged (PagedAttention in JAX).")
    p.add_argument("prompts", nargs="*", help="prompts; none or '-' reads standard input, one per line")
    p.add_argument("--file", type=Path, help="prompts file: one per line, or .jsonl with 'prompt' + sampling options "
                                                   "(and 'priority', with --scheduling-policy priority)")
    p.add_argument("--model", help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--chat-template", help="for --chat: a chat template instead of the model's (a file, or the "
                                           "Jinja template itself)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt at a time)")
    p.add_argument("--json", action="store_true", help="print one JSON object per request and a JSON summary")
    p.add_argument("--lora", metavar="PATH", help="run every prompt with this LoRA adapter (a PEFT folder); "
                                                  "implies --enable-lora")
    s = p.add_argument_group("sampling")
    for flag, typ, field in _SAMPLING:
        s.add_argument(flag, type=typ, dest=field, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=lambda v: [int(t) for t in v.split(",")], default=None)
    s.add_argument("--include-stop-str-in-output", action="store_true", default=None,
                   help="keep the stop string that ended a completion in its text")
    s.add_argument("--ignore-eos", action="store_true", default=None)
    s.add_argument("--beam-search", action="store_true", dest="use_beam_search", default=None)
    g = s.add_mutually_exclusive_group()  # structured outputs (SamplingParams.structured_outputs): one at most
    g.add_argument("--json-schema", metavar="SCHEMA", help="the output is JSON matching this schema "
                   "(JSON text, or @path to a file holding it)")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", help="the output matches this regular expression")
    g.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    g.add_argument("--grammar", help="the output follows this Lark or GBNF grammar (text, or @path)")
    e = add_engine_args(p)
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _structured_outputs(args) -> dict | None:
    """The structured-output flags as ``SamplingParams.structured_outputs`` (a dict), or None."""
    def text(value: str, flag: str) -> str:
        if not value.startswith("@"):
            return value
        path = Path(value[1:])
        if not path.is_file():
            raise FileNotFoundError(f"{flag}: file not found: {path}")
        return path.read_text()

    if args.json_schema is not None:
        return {"json": text(args.json_schema, "--json-schema")}
    if args.grammar is not None:
        return {"grammar": text(args.grammar, "--grammar")}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    return None


def _read_prompts(args) -> list[tuple[str, dict]]:
    items: list[tuple[str, dict]] = []
    if args.file is not None:
        if not args.file.is_file():
            raise FileNotFoundError(f"prompts file not found: {args.file}")
        for n, line in enumerate(args.file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            if args.file.suffix == ".jsonl":
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.file}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError(f"{args.file}:{n}: each line needs a string 'prompt'")
                items.append((obj.pop("prompt"), obj | {"_line": f"{args.file}:{n}"}))
            else:
                items.append((line, {}))
    stdin = "-" in args.prompts or (not args.prompts and args.file is None)
    items += [(q, {}) for q in args.prompts if q != "-"]
    if stdin:  # '-' among the prompts, or no prompts at all
        items += [(line, {}) for line in sys.stdin.read().splitlines() if line.strip()]
    if not items:
        raise ValueError("no prompts: pass them as arguments, with --file, or on standard input")
    return items


def _json_logprobs(positions) -> list:
    """``--json``'s logprobs: a list a position (None where nothing precedes the token) of
    ``{token, token_id, logprob, rank}`` entries, the chosen token's first."""
    return [None if p is None else [{"token": lp.decoded_token, "token_id": t, "logprob": lp.logprob,
                                     "rank": lp.rank} for t, lp in p.items()] for p in positions]


def _percentile(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q)) if xs else float("nan")


def run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stream and args.json:
        parser.error("--stream prints text as it comes; --json prints whole outputs: give one")
    for option, value in (("--system", args.system), ("--chat-template", args.chat_template)):
        if value is not None and not args.chat:
            parser.error(f"{option} is a chat option: add --chat")
    try:
        template = None if args.chat_template is None else load_chat_template(args.chat_template)
    except (OSError, ValueError, TypeError) as e:
        parser.error(str(e))
    from jaxpaged.engine import LLM
    from jaxpaged.sampling_params import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    # The options' defaults: greedy, 128 tokens, but what the model's generation config sets.
    model_defaults = default_sampling_overrides(args.generation_config, args.model)
    base = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if structured := _structured_outputs(args):
        base["structured_outputs"] = structured
    if base.get("use_beam_search") and "beam_width" not in base:
        base["beam_width"] = 4
    items = _read_prompts(args)
    params, priorities = [], []
    for _, extra in items:
        where = extra.pop("_line", None)
        try:
            priority = extra.pop("priority", 0)
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise TypeError(f"priority must be an int, got {priority!r}")
            if priority and args.scheduling_policy != "priority":
                raise ValueError(f"priority {priority} needs --scheduling-policy priority")
            priorities.append(priority)
            unknown = set(extra) - fields
            if unknown:
                raise ValueError(f"unknown sampling options {sorted(unknown)}")
            given = {**base, **extra}
            defaults = {"max_tokens": 128, "temperature": 0.0,
                        **for_request(model_defaults, beam_search=bool(given.get("use_beam_search")))}
            params.append(SamplingParams(**{**defaults, **given}))
        except (ValueError, TypeError) as e:
            if where is None:
                raise
            raise type(e)(f"{where}: {e}") from None
    from jaxpaged.lora import LoRARequest

    lora = None if args.lora is None else LoRARequest(Path(args.lora).name or "lora", 1, args.lora)
    llm = LLM(args.model, **{**engine_kwargs(args), "enable_lora": args.enable_lora or lora is not None})
    prompts = []
    for text, _ in items:
        if args.chat:
            conv = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": text}]
            prompts.append(llm.chat_prompt(conv, chat_template=template))
        else:
            prompts.append(text)

    start = time.perf_counter()
    if args.stream:
        for n, (prompt, sp) in enumerate(zip(prompts, params), 1):  # every prompt checked before any runs
            llm.inputs.check(prompt, sp, what=f"prompt {n}")
            if sp.n > 1 or sp.use_beam_search:
                raise ValueError(f"--stream prints one completion a prompt; prompt {n} asks for "
                                 f"{'beam search' if sp.use_beam_search else f'n={sp.n}'}")
        for prompt, sp in zip(prompts, params):
            for delta in llm.stream(prompt, sp, lora_request=lora):
                print(delta, end="", flush=True)
            print()
        elapsed = time.perf_counter() - start
        stats = llm.stats()
        print(f"[{stats['num_steps']} steps in {elapsed:.1f} s]", file=sys.stderr)
        return 0
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress and not args.json, priority=priorities,
                           lora_request=lora)
    elapsed = time.perf_counter() - start
    for (text, _), o in zip(items, outputs):
        if args.json:
            line = {"request_id": o.request_id, "prompt": text, "outputs": [
                {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob}
                | ({"logprobs": _json_logprobs(c.logprobs)} if c.logprobs is not None else {})
                for c in o.outputs], "num_prompt_tokens": len(o.prompt_token_ids),
                "num_cached_tokens": o.num_cached_tokens}
            if o.prompt_logprobs is not None:
                line["prompt_logprobs"] = _json_logprobs(o.prompt_logprobs)
            print(json.dumps(line))
        else:
            for c in o.outputs:
                prefix = f"[{c.index}] " if len(o.outputs) > 1 else ""
                print(prefix + c.text)
            if len(outputs) > 1:
                print("-" * 40)
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    n_gen = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttft = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    stats = llm.stats()
    summary = {
        "requests": len(outputs), "prompt_tokens": n_prompt, "generated_tokens": n_gen,
        "seconds": round(elapsed, 3), "generated_tok_per_s": round(n_gen / elapsed, 2),
        "ttft_p50_s": round(_percentile(ttft, 50), 3), "ttft_p99_s": round(_percentile(ttft, 99), 3),
        "peak_kv_utilization": round(stats["peak_kv_utilization"], 4),
        "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 4),
        "preemptions": stats["num_preemptions"], "compiled_shapes": stats["num_compiled_shapes"],
    }
    if args.speculative_config is not None:
        summary["spec_acceptance_rate"] = round(stats["spec_acceptance_rate"], 4)
        summary["spec_mean_acceptance_length"] = round(stats["spec_mean_acceptance_length"], 3)
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        drafts = (f" | drafts accepted {summary['spec_acceptance_rate']:.1%}, "
                  f"{summary['spec_mean_acceptance_length']:.2f} tokens a drafting step"
                  if args.speculative_config is not None else "")
        print(f"\n{summary['requests']} requests | {n_prompt} prompt + {n_gen} generated tokens in "
              f"{elapsed:.1f} s ({summary['generated_tok_per_s']} tok/s) | TTFT p50 {summary['ttft_p50_s']} s, "
              f"p99 {summary['ttft_p99_s']} s | peak KV utilization {summary['peak_kv_utilization']:.1%} | "
              f"prefix hit rate {summary['prefix_cache_hit_rate']:.1%} | preemptions {summary['preemptions']}{drafts}",
              file=sys.stderr)
    return 0


def exit_code(run, prog: str, argv: list[str] | None = None) -> int:
    """``run(argv)``, with a bad input or a missing file as one ``prog: error: ...`` line and
    exit status 1, and Ctrl-C as 130 (the entry points of ``jaxpaged-generate`` and ``-serve``)."""
    try:
        return run(argv)
    except (FileNotFoundError, ValueError, TypeError, OSError) as e:
        msg = " ".join(str(e).split())  # one line
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    return exit_code(run, PROG, argv)


if __name__ == "__main__":
    sys.exit(main())
