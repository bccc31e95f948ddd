"""Latency and throughput of a running ``jaxpaged-serve`` under Poisson arrivals, over HTTP.

    jaxpaged-serve --port 8000 &
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --num-requests 64 --rate 2

Requests arrive at ``--rate`` per second (exponential gaps, seeded), each a streamed
``/v1/completions`` of token-id prompts (random ids, ``--prompt-len`` tokens) asking for
``--output-len`` tokens with ``ignore_eos``, greedy. The run is bounded by
``--num-requests`` and ``--max-duration`` (requests not started by then are not sent;
those in flight are awaited). TTFT counts from each request's scheduled arrival; the
inter-token latency is the gap between consecutive streamed chunks of a request (one
chunk per engine step) divided by the tokens it carried. Reports p50/p99 of both, request
and token throughput, and the server's own counters from ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np

from bench_common import percentile, poisson_arrivals


async def one(client: httpx.AsyncClient, body: dict, arrival: float) -> dict:
    ttft, gaps, tokens, last = None, [], 0, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if not ch["choices"]:
                continue
            n = len(ch["choices"][0]["logprobs"]["tokens"])
            now = time.perf_counter()
            if ttft is None:
                ttft = now - arrival
            elif n:
                gaps += [(now - last) / n] * n
            tokens += n
            last = now
    return {"ttft": ttft, "itl": gaps, "tokens": tokens, "end": time.perf_counter()}


async def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        vocab = args.vocab_size
        start = time.perf_counter()
        tasks = []
        for offset in poisson_arrivals(args.num_requests, args.rate, args.seed):
            if offset > args.max_duration:
                break
            t = start + float(offset)
            body = {"model": model, "prompt": rng.integers(100, vocab, args.prompt_len).tolist(),
                    "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
                    "logprobs": 0}
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, body, t)))
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)  # a 503 is counted, not fatal
        results = [r for r in outcomes if not isinstance(r, BaseException)]
        failed = [repr(r)[:120] for r in outcomes if isinstance(r, BaseException)]
        if not results:
            raise SystemExit(f"every request failed, e.g. {failed[0]}")
        elapsed = max(r["end"] for r in results) - start
        metrics = (await client.get("/metrics")).text
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    server = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith(("jaxpaged:num_preemptions_total", "jaxpaged:prefix_cache_hit_rate"))}
    return {
        "requests": len(results), "rate": args.rate, "seconds": round(elapsed, 2),
        "requests_per_s": round(len(results) / elapsed, 3), "generated_tok_per_s": round(tokens / elapsed, 1),
        "failed": len(failed), "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
        "itl_p50_s": round(percentile(itl, 50), 4), "itl_p99_s": round(percentile(itl, 99), 4),
        **server,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-duration", type=float, default=120.0, help="seconds of arrivals at most")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(run(p.parse_args(argv))), indent=1))


if __name__ == "__main__":
    main()
