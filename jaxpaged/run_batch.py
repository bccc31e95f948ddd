"""``jaxpaged-run-batch``: a file of OpenAI batch requests, run offline (vLLM's ``run_batch``;
also ``python -m jaxpaged.run_batch``).

    jaxpaged-run-batch -i requests.jsonl -o results.jsonl [engine and API options]

Each input line is one request in OpenAI's batch format::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

with ``url`` one of :data:`URLS`. Each output line answers the input line at the same place::

    {"id": "batch_req_...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "...", "body": {...the endpoint's response...}}}

The requests go, all at once, through ``jaxpaged-serve``'s app in this process (no socket): the
same validation, defaults and responses as the server, and one engine batching them all. A line
that is not a request (bad JSON, a missing field, another method or url, ``"stream": true``) or
that the endpoint refuses gets its status code and the error's message in ``error``; the other
lines run. The output is written to a temporary file beside it, then renamed into place.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

PROG = "jaxpaged-run-batch"
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/responses")


def build_parser() -> argparse.ArgumentParser:
    from jaxpaged.cli import add_engine_args
    from jaxpaged.serve import add_app_args

    p = argparse.ArgumentParser(prog=PROG, description="Run a file of OpenAI batch requests (JSON lines) offline.")
    p.add_argument("-i", "--input-file", required=True, type=Path, help="the requests, one JSON object a line")
    p.add_argument("-o", "--output-file", required=True, type=Path, help="the results, one JSON object a line")
    add_app_args(p)
    add_engine_args(p)
    return p


class BadLine(ValueError):
    """An input line that is not a request; ``custom_id`` its id where it has a string one."""

    def __init__(self, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(line: str) -> tuple[str, str, dict[str, Any]]:
    """``(custom_id, url, body)`` of an input line; :class:`BadLine` saying what is wrong with it."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadLine(f"the line is not JSON: {e}") from None
    if not isinstance(request, dict):
        raise BadLine(f"a request is a JSON object, got {type(request).__name__}")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str):
        raise BadLine(f"custom_id must be a string, got {custom_id!r}")
    method, url, body = request.get("method"), request.get("url"), request.get("body")
    if method != "POST":
        raise BadLine(f"method must be 'POST', got {method!r}", custom_id)
    if url not in URLS:
        raise BadLine(f"url {url!r} is not supported; choose from {', '.join(URLS)}", custom_id)
    if not isinstance(body, dict):
        raise BadLine(f"body must be a JSON object, got {type(body).__name__}", custom_id)
    if body.get("stream"):
        raise BadLine("stream is not supported in a batch", custom_id)
    return custom_id, url, body


def _output(custom_id: str | None, status: int, body: Any, error: str | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "error": error,
            "response": {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}",
                         "body": body if error is None else None}}


async def run_lines(app, lines: list[str], *, progress: bool = False) -> list[dict[str, Any]]:
    """Every line's output, in order: the requests posted to ``app`` concurrently."""
    import httpx
    from tqdm.auto import tqdm

    bar = tqdm(total=len(lines), desc="batch", unit="req", disable=None if progress else True, dynamic_ncols=True)
    # raise_app_exceptions=False: an internal error is that request's 500, as the server answers it.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        async def one(line: str) -> dict[str, Any]:
            try:
                custom_id, url, body = parse_line(line)
            except BadLine as e:
                bar.update()
                return _output(e.custom_id, 400, None, str(e))
            try:
                # As JSON the server parses (ASCII escapes: a lone surrogate or NaN is its to refuse).
                r = await client.post(url, content=json.dumps(body, ensure_ascii=True).encode(),
                                      headers={"content-type": "application/json"})
                payload = r.json()
            except Exception as e:  # noqa: BLE001  (one line's failure is that line's answer)
                return _output(custom_id, 500, None, f"internal error: {type(e).__name__}: {e}")
            finally:
                bar.update()
            if r.status_code == 200:
                return _output(custom_id, 200, payload, None)
            error = payload.get("error") if isinstance(payload, dict) else None
            return _output(custom_id, r.status_code, None,
                           error.get("message", str(error)) if isinstance(error, dict) else str(payload))

        try:
            return list(await asyncio.gather(*(one(line) for line in lines)))
        finally:
            bar.close()


def run(argv: list[str] | None = None) -> int:
    from jaxpaged.serve import start

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Lines end at "\n" only: JSON strings may hold U+2028 and the like unescaped.
        text = args.input_file.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"--input-file {args.input_file}: {e}")
    lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    out_dir = args.output_file.resolve().parent
    if not out_dir.is_dir() or args.output_file.is_dir():
        parser.error(f"--output-file {args.output_file}: " + ("is a folder" if args.output_file.is_dir()
                                                              else f"no folder {out_dir}"))
    engine, app, _ = start(parser, args)
    try:
        outputs = asyncio.run(run_lines(app, lines, progress=True))
    finally:
        engine.shutdown()
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{args.output_file.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(o) + "\n" for o in outputs)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a file opened for writing would be, not mkstemp's 0600
        os.replace(tmp, args.output_file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    failed = sum(o["error"] is not None for o in outputs)
    print(f"{PROG}: {len(outputs)} requests, {failed} failed; results in {args.output_file}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from jaxpaged.cli import exit_code

    return exit_code(run, PROG, argv)


if __name__ == "__main__":
    sys.exit(main())
