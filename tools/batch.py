"""Run a file of OpenAI batch requests through the engine:
``python -m tools.batch -i requests.jsonl -o results.jsonl [--resume] [engine flags]``.

The input is OpenAI's batch format, one JSON object per line: ``custom_id``, ``method``
(``POST``), ``url`` (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, or with a
pooling model (``--runner pooling``) ``/v1/embeddings``, ``/pooling``, ``/v1/score`` and ``/v1/rerank``, or
with a model that takes audio ``/v1/audio/transcriptions`` and ``/v1/audio/translations``, whose body
names its audio by ``file_url``, a data, http(s) or file URL, as vLLM's run_batch does) and
``body``, the request the
server would take (``stream`` and ``stream_options`` are ignored, as OpenAI's batches do). The
output is OpenAI's batch output format, one line per input line, in the order they finish:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, the body
being what the server answers for that request (an error body with its status for a request the
server would refuse). A line that cannot be read (invalid JSON, no custom_id, an unknown url or
method) gets a record with ``response`` null and ``error`` ``{"code", "message", "line"}``.

Every line is handed to the engine at once; the engine's own admission and scheduling take it
from there. Each result is written and flushed as it finishes, so a run that is interrupted
loses nothing: ``--resume`` skips the custom ids (and unreadable lines) already in the output.
``-i -`` reads standard input, ``-o -`` writes standard output. A progress bar on standard error
shows requests done, output tokens per second and the time left."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import IO, Any

from actors.api import Progress
from actors.engine.args import EngineArgs
from actors.frontend.reasoning import REASONING_PARSERS
from tools import config_file
from tools.config_file import add_config_flag

log = logging.getLogger("troupe.batch")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/pooling", "/v1/score",
        "/v1/rerank", "/v1/audio/transcriptions", "/v1/audio/translations")
IGNORED_FIELDS = ("stream", "stream_options")     # a batch answers whole, as OpenAI's does
RETRY_STATUS = 503                                 # the engine restarting or its queue full
MAX_RETRIES = 20
BATCH_MAX_NUM_SEQS = 256                           # the offline benchmark's default too


class BatchError(Exception):
    """The input as a whole cannot be run (duplicate custom ids, an unreadable file)."""


@dataclass(slots=True)
class Line:
    number: int                      # 1-based, in the input file
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None      # (code, message): the line cannot be run


def parse_line(number: int, text: str) -> Line:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Line(number, None, error=("invalid_json", f"line {number} is not valid JSON: {exc}"))
    if not isinstance(obj, dict):
        return Line(number, None, error=("invalid_request", f"line {number} is not a JSON object"))
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, error=("missing_custom_id", f"line {number} has no custom_id (a string)"))
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if not isinstance(method, str) or method.upper() != "POST":
        return Line(number, custom_id, error=("invalid_method", f"method {method!r}: only POST is supported"))
    if url not in URLS:
        return Line(number, custom_id, error=("invalid_url", f"url {url!r}: one of {', '.join(URLS)}"))
    if not isinstance(body, dict):
        return Line(number, custom_id, error=("invalid_body", "body must be a JSON object"))
    return Line(number, custom_id, url, {k: v for k, v in body.items() if k not in IGNORED_FIELDS})


def read_lines(stream: IO[str]) -> list[Line]:
    """Every non-blank line of the input; duplicate custom ids refuse the whole file."""
    lines = [parse_line(i, text) for i, text in enumerate(stream, 1) if text.strip()]
    counts = Counter(line.custom_id for line in lines if line.custom_id is not None)
    dups = sorted(cid for cid, n in counts.items() if n > 1)
    if dups:
        shown = ", ".join(repr(d) for d in dups[:10]) + (f" and {len(dups) - 10} more" if len(dups) > 10 else "")
        raise BatchError(f"duplicate custom_id in the input: {shown} (each must be unique)")
    return lines


def already_done(path: str) -> tuple[set[str], set[int]]:
    """The custom ids, and the line numbers of unreadable lines, recorded in an earlier run's
    output. A last line cut short (the run was killed while writing it) is removed."""
    ids: set[str] = set()
    numbers: set[int] = set()
    if not os.path.exists(path):
        return ids, numbers
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    for raw in data[:end].splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if rec.get("custom_id") is not None:
            ids.add(rec["custom_id"])
        elif isinstance(rec.get("error"), dict) and isinstance(rec["error"].get("line"), int):
            numbers.add(rec["error"]["line"])
    return ids, numbers


def record(custom_id: str | None, response: dict[str, Any] | None,
           error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": error}


class Runner:
    """Answers lines through the server's own request handling (``start_chat`` /
    ``start_completion``), without HTTP."""

    def __init__(self, server: Any, out: IO[str], bar: Progress | None = None) -> None:
        self.server = server
        self.out = out
        self.bar = bar
        self.started = time.monotonic()
        self.output_tokens = 0
        self.done = 0
        self.errors = 0
        self.unfinished = 0
        self.finished = self.started
        self.steps = self.max_batch_size = 0           # the engine's, for the summary

    def write(self, rec: dict[str, Any]) -> None:
        self.out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.out.flush()
        self.done += 1
        if rec["error"] is not None or (rec["response"] or {}).get("status_code", 200) != 200:
            self.errors += 1

    async def answer(self, line: Line) -> tuple[int, dict[str, Any]]:
        """The status and JSON body the server gives this line's request."""
        from actors.frontend.chat import start_chat
        from actors.frontend.completions import start_completion
        from actors.frontend.embeddings import EMBEDDINGS, POOLING, pooled
        from actors.frontend.scoring import RERANK_PATHS, SCORE_PATHS, scored
        from actors.frontend.protocol import ChatCompletionRequest, CompletionRequest
        from actors.frontend.responses import ResponsesRequest, start_response
        from actors.frontend.speech_to_text import TRANSCRIPTIONS, TRANSLATIONS, batch_speech
        chat = line.url == URLS[0]
        body = json.dumps(line.body).encode()

        async def call() -> Any:
            arrival = time.time()
            if line.url in (EMBEDDINGS, POOLING):
                return await pooled(self.server, line.url, body)
            if line.url in SCORE_PATHS + RERANK_PATHS:
                return await scored(self.server, line.url, body)
            if line.url in (TRANSCRIPTIONS, TRANSLATIONS):
                return await batch_speech(self.server, line.url, line.body or {})
            if line.url == URLS[2]:
                answer = await start_response(self.server, self.server.decode(body, ResponsesRequest), arrival)
                return await answer.whole_response()
            if chat:
                gen, _ = await start_chat(self.server, self.server.decode(body, ChatCompletionRequest), arrival)
            else:
                gen, _ = await start_completion(self.server, self.server.decode(body, CompletionRequest), arrival)
            return await gen.whole()
        response = await self.server.answer(call, f"batch line {line.number}")
        return response.status, json.loads(response.body)

    async def run_line(self, line: Line) -> None:
        if line.error is not None:
            code, message = line.error
            self.write(record(line.custom_id, None, {"code": code, "message": message, "line": line.number}))
            if self.bar is not None:
                self.bar.update(0)
            return
        for attempt in range(MAX_RETRIES + 1):
            status, body = await self.answer(line)
            if status != RETRY_STATUS:
                break
            if attempt == MAX_RETRIES:        # left out of the output: a --resume runs it again
                self.unfinished += 1
                log.error("line %d (%s): %s; not recorded", line.number, line.custom_id,
                          body.get("error", {}).get("message"))
                return
            await asyncio.sleep(min(0.5 * 2 ** attempt, 10.0))
        used = (body.get("usage") or {}) if status == 200 else {}
        tokens = used.get("completion_tokens", used.get("output_tokens", 0))
        self.output_tokens += tokens
        request_id = body.get("id") or f"batch-{uuid.uuid4().hex}"
        self.write(record(line.custom_id, {"status_code": status, "request_id": request_id, "body": body}, None))
        if self.bar is not None:
            self.bar.update(tokens)


async def run(args: argparse.Namespace, lines: list[Line], out: IO[str]) -> Runner:
    from actors.frontend.app import OpenAIServer, ServerOptions
    from actors.frontend.launch import start_frontend
    fe = await start_frontend(EngineArgs.from_cli_args(args).create_engine_config())
    bar = None if args.no_progress else Progress(len(lines), "Batch")
    runner = Runner(OpenAIServer(fe.client, ServerOptions(lenient=args.lenient, reasoning_parser=args.reasoning_parser)),
                    out, bar)
    try:
        await asyncio.gather(*(runner.run_line(line) for line in lines))
        runner.finished = time.monotonic()
        runner.steps, runner.max_batch_size = fe.client.stats.steps, fe.client.stats.max_batch_size
    finally:
        if bar is not None:
            bar.close()
        await fe.shutdown()
    return runner


def parse_args(argv: list[str] | None = None, prog: str = "python -m tools.batch") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("-i", "--input-file", required=True, help="OpenAI batch input (JSONL); '-': standard input")
    p.add_argument("-o", "--output-file", required=True, help="where results go (JSONL); '-': standard output")
    p.add_argument("--resume", action="store_true",
                   help="skip the requests whose custom_id is already in the output file, and append")
    p.add_argument("--lenient", action="store_true", help="drop unknown body fields instead of an error")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="chat answers' reasoning and content split as the server's --reasoning-parser splits them")
    p.add_argument("--log-level", default="WARNING")
    # an offline job: as vLLM's offline engine, up to 256 requests in a step (the server: 64)
    EngineArgs.add_cli_args(p, max_num_seqs=BATCH_MAX_NUM_SEQS)
    add_config_flag(p)
    args = config_file.parse_args(p, argv)
    if args.resume and args.output_file == "-":
        p.error("--resume needs an output file, not standard output")
    return args


def main(argv: list[str] | None = None, prog: str = "python -m tools.batch") -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [batch] %(name)s: %(message)s")
    try:
        if args.input_file == "-":
            lines = read_lines(sys.stdin)
        else:
            with open(args.input_file, encoding="utf-8") as f:
                lines = read_lines(f)
        skip_ids, skip_numbers = (already_done(args.output_file) if args.resume else (set(), set()))
    except (OSError, UnicodeDecodeError, BatchError) as exc:
        print(f"troupe batch: error: {exc}", file=sys.stderr)
        return 2
    todo = [line for line in lines if line.custom_id not in skip_ids
            and not (line.custom_id is None and line.number in skip_numbers)]
    if len(todo) < len(lines):
        print(f"troupe batch: {len(lines) - len(todo)} of {len(lines)} requests already in "
              f"{args.output_file}; running the other {len(todo)}", file=sys.stderr)
    out = sys.stdout if args.output_file == "-" else open(args.output_file, "a" if args.resume else "w",
                                                          encoding="utf-8")
    import uvloop
    try:
        runner = uvloop.run(run(args, todo, out))
    except KeyboardInterrupt:
        print(f"troupe batch: interrupted; the results written so far are in {args.output_file} "
              "(--resume runs the rest)", file=sys.stderr)
        return 130
    except Exception as exc:
        log.debug("the batch failed", exc_info=True)
        print(f"troupe batch: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if out is not sys.stdout:
            out.close()
    seconds = runner.finished - runner.started        # from the model loaded to the last answer
    print(json.dumps({"requests": runner.done, "errors": runner.errors, "not_run": runner.unfinished,
                      "output_tokens": runner.output_tokens, "seconds": round(seconds, 3),
                      "output_tok_per_s": round(runner.output_tokens / max(seconds, 1e-9), 2),
                      "engine_steps": runner.steps, "max_batch_size": runner.max_batch_size}),
          file=sys.stderr, flush=True)
    if runner.unfinished:
        print(f"troupe batch: {runner.unfinished} requests could not run (the engine was not "
              "available); --resume runs them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
