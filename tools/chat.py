"""``python -m tools.chat``: a terminal chat that streams the reply as it is generated.

By default it runs the engine in this process; ``--url`` talks to a running server instead
(vLLM's ``vllm chat`` flags: ``--url http://host:port/v1``, ``--model-name``, ``--api-key``,
``--system-prompt``, ``-q/--quick MESSAGE`` for one reply and exit, ``--stats`` for the time to
the first token and tokens per second after each reply). ``python -m tools.complete`` (``troupe
complete``, vLLM's ``vllm complete``) is the same with each line a prompt to complete, no history.
Ctrl-C while a reply streams stops it: the request is aborted (the output iterator is closed;
with ``--url``, the HTTP response), the part already shown stays in the conversation as the
assistant's turn, and the prompt comes back. Ctrl-C at the prompt clears the line; /exit or
Ctrl-D leaves. /help lists the commands; ``/image PATH_OR_URL`` attaches a picture to the next
message (for a model that takes images: a file is sent as a data URL, an http(s) URL as it is),
``/video PATH_OR_URL`` a video (a model that takes videos), ``/audio PATH_OR_URL`` an audio clip
(a model that takes audio)."""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import mimetypes
import os
import signal
import sys
import threading
import time
from contextlib import aclosing
from typing import AsyncIterator

COMMANDS = {
    "/help": "list these commands",
    "/history": "show the conversation so far",
    "/reset": "forget the conversation (the --system prompt stays)",
    "/image": "/image PATH_OR_URL attaches a picture to the next message (a model that takes images)",
    "/video": "/video PATH_OR_URL attaches a video to the next message (a model that takes videos)",
    "/audio": "/audio PATH_OR_URL attaches an audio clip to the next message (a model that takes audio)",
    "/exit": "leave (so does Ctrl-D)",
}
SYSTEM_HINT = ("Type a message and press Enter; Ctrl-C stops a reply, /help lists the commands, "
               "/exit leaves.")
STOPPED = "[stopped]"


class Counts:
    """What a reply's stream reported besides its text: its generated tokens."""

    def __init__(self) -> None:
        self.tokens = 0


async def _local_stream(llm, messages, params, counts: Counts, complete: bool) -> AsyncIterator[str]:
    outputs = llm.generate(messages, params) if complete else llm.chat(messages, params)
    async for out in outputs:                  # DELTA outputs: each holds what is new
        if out.error:
            raise RuntimeError(out.error)
        counts.tokens += len(out.token_ids)
        if out.text:
            yield out.text


def base_url(url: str) -> str:
    """The server's root: vLLM's form ends with /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _remote_stream(session, args, messages, counts: Counts) -> AsyncIterator[str]:
    prompt = {"prompt": messages} if args.complete else {"messages": messages}
    body = {**prompt, "stream": True, "stream_options": {"include_usage": True},
            "temperature": args.temperature, "max_tokens": args.max_tokens}
    if args.model_name:
        body["model"] = args.model_name
    path = "/v1/completions" if args.complete else "/v1/chat/completions"
    async with session.post(base_url(args.url) + path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        try:
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if event.get("usage"):
                    counts.tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    text = choice.get("text") if args.complete else choice["delta"].get("content")
                    if text:
                        yield text
        except BaseException:
            resp.close()          # the server sees the client leave and aborts the request
            raise


class Timed:
    """A reply's stream, timed: when it started, when its first text came."""

    def __init__(self, stream: AsyncIterator[str]) -> None:
        self.stream = stream
        self.start = time.perf_counter()
        self.first: float | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        async with aclosing(self.stream) as pieces:
            async for piece in pieces:
                if self.first is None:
                    self.first = time.perf_counter()
                yield piece

    def report(self, tokens: int) -> None:
        """vLLM's ``--stats`` lines."""
        total = time.perf_counter() - self.start
        if self.first is None or total <= 0:
            return
        print(f"{'TTFT:':<5} {(self.first - self.start) * 1000:.2f} ms")
        print(f"{'TPS:':<5} {tokens / total:.2f} tokens/s ({tokens} tokens in {total:.2f}s)")


class LineReader:
    """Lines of stdin, read by a daemon thread: neither a Ctrl-C nor leaving waits on a read
    that is blocked in the terminal. ``""`` is the end of the input."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.lines: asyncio.Queue[str] = asyncio.Queue()
        threading.Thread(target=self._pump, args=(loop,), name="stdin", daemon=True).start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        for line in iter(sys.stdin.readline, ""):
            if not self._put(loop, line):
                return
        self._put(loop, "")

    def _put(self, loop: asyncio.AbstractEventLoop, line: str) -> bool:
        try:
            loop.call_soon_threadsafe(self.lines.put_nowait, line)
        except RuntimeError:      # the loop is closed: the chat has ended
            return False
        return True

    async def readline(self) -> str:
        return await self.lines.get()


class Interrupts:
    """The SIGINT handler: stops the reply being streamed (``reply``), else clears the line."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.reply: asyncio.Task | None = None

    def __call__(self) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.cancel()
            return
        # the terminal drops the half-typed line itself (canonical mode flushes it on ^C)
        print("\n(Ctrl-C clears the line; /exit or Ctrl-D leaves)", file=sys.stderr, flush=True)
        if self.interactive:
            print("> ", end="", flush=True)


async def _show_reply(stream: AsyncIterator[str], shown: list[str]) -> None:
    async with aclosing(stream) as pieces:
        async for piece in pieces:
            shown.append(piece)
            print(piece, end="", flush=True)


async def stream_reply(stream: AsyncIterator[str], interrupts: Interrupts) -> tuple[str, bool]:
    """Print the reply as it comes: (the text shown, whether Ctrl-C stopped it). A failure
    raises after the text shown so far."""
    shown: list[str] = []
    task = asyncio.ensure_future(_show_reply(stream, shown))
    interrupts.reply = task
    try:
        await asyncio.wait([task])
    finally:
        interrupts.reply = None
        if not task.done():       # this coroutine itself was cancelled: take the reply down too
            task.cancel()
    if task.cancelled():
        return "".join(shown), True
    task.result()
    return "".join(shown), False


def image_part(where: str, kind: str = "image") -> dict:
    """A chat image (``kind`` "video": video, "audio": audio clip) part: an http(s) or data URL as
    it is, a file as a data URL (ValueError for a file that cannot be read)."""
    field = f"{kind}_url"
    if where.startswith(("http://", "https://", "data:")):
        return {"type": field, field: {"url": where}}
    path = os.path.expanduser(where)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    media = mimetypes.guess_type(path)[0] or {"video": "video/mp4", "audio": "audio/wav"}.get(kind, "image/png")
    return {"type": field, field: {"url": f"data:{media};base64,{base64.b64encode(data).decode()}"}}


def shown_content(content) -> str:
    """A message's content as /history shows it (an image as [image], a video as [video], an
    audio clip as [audio])."""
    if isinstance(content, str):
        return content
    kinds = {"video_url": "[video]", "audio_url": "[audio]", "input_audio": "[audio]"}
    return " ".join(p["text"] if p.get("type") == "text" else kinds.get(p.get("type"), "[image]") for p in content)


def command(line: str, messages: list[dict], system: str | None, images: list[dict] | None = None) -> bool:
    """Run a /command; False for /exit. ``images``: the parts /image, /video and /audio attached
    for the next message."""
    if line == "/exit":
        return False
    if line == "/reset":
        messages[:] = messages[:1] if system else []
        if images is not None:
            images.clear()
        print("(conversation cleared)", file=sys.stderr)
    elif line.split(" ", 1)[0] in ("/image", "/video", "/audio"):
        kind, _, where = line[1:].partition(" ")
        where = where.strip()
        if not where or images is None:
            print(f"usage: /{kind} PATH_OR_URL (then type the message it goes with)", file=sys.stderr)
            return True
        try:
            images.append(image_part(where, kind))
        except ValueError as exc:
            print(f"({exc})", file=sys.stderr)
            return True
        print(f"({kind} {sum(p['type'] == f'{kind}_url' for p in images)} attached to the next message)",
              file=sys.stderr)
    elif line == "/history":
        for m in messages:
            print(f"{m['role']}: {shown_content(m['content'])}")
    elif line == "/help":
        for name, what in COMMANDS.items():
            print(f"{name:<10} {what}")
        print("Ctrl-C     stop the reply being written (at the prompt: clear the line)")
    else:
        print(f"unknown command {line}; /help lists the commands", file=sys.stderr)
    return True


async def repl(args: argparse.Namespace) -> int:
    from actors.api import AsyncLLM, RequestOutputKind, SamplingParams
    session = llm = None
    if args.url:
        import aiohttp
        key = args.api_key or os.environ.get("OPENAI_API_KEY")
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                        headers={"Authorization": f"Bearer {key}"} if key else None)
    else:
        print("loading the model...", file=sys.stderr, flush=True)
        llm = await AsyncLLM.create(args.model or args.model_name, disable_log_stats=True)   # a conversation, not a log
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            output_kind=RequestOutputKind.DELTA)
    messages: list[dict] = []
    images: list[dict] = []            # /image's parts, sent with the next message
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty() and args.quick is None
    loop = asyncio.get_running_loop()
    interrupts = Interrupts(interactive)
    loop.add_signal_handler(signal.SIGINT, interrupts)
    reader = LineReader(loop) if args.quick is None else None
    if interactive:
        print(SYSTEM_HINT, file=sys.stderr)
    try:
        while True:
            if interactive:
                print("\n> ", end="", flush=True)
            line = args.quick if reader is None else await reader.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/") and reader is not None:
                if not command(line, messages, args.system, None if args.complete else images):
                    break
                continue
            messages.append({"role": "user", "content": [*images, {"type": "text", "text": line}] if images
                             else line})
            images.clear()
            counts = Counts()
            asked = line if args.complete else messages
            timed = Timed(_remote_stream(session, args, asked, counts) if session is not None
                          else _local_stream(llm, asked, params, counts, args.complete))
            try:
                reply, stopped = await stream_reply(aiter(timed), interrupts)
            except Exception as exc:        # a failed request ends the turn, not the chat
                print(f"\n[error: {exc}]", file=sys.stderr)
                failed = messages.pop()["content"]
                if isinstance(failed, list):       # its pictures wait for the next message again
                    images[:] = [p for p in failed if p.get("type") in ("image_url", "video_url", "audio_url")]
                if reader is None:
                    return 1
                continue
            if stopped:
                print(f"\n{STOPPED}", file=sys.stderr, flush=True)
            else:
                print(flush=True)
            if args.stats:
                timed.report(counts.tokens)
            if args.complete:
                messages.clear()            # each prompt on its own
            else:
                messages.append({"role": "assistant", "content": reply})
            if reader is None:
                break
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if session is not None:
            await session.close()
        if llm is not None:
            await llm.shutdown()
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m tools.chat", complete: bool = False) -> None:
    what = "a terminal prompt completer" if complete else __doc__.splitlines()[0]
    p = argparse.ArgumentParser(prog=prog, description=what)
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 or vLLM's "
                                               "http://127.0.0.1:8000/v1 (default: the engine in this process)")
    p.add_argument("--model-name", default=None, help="the model a server is asked for (vLLM's; default: the "
                                                      "server's own); in this process, the model to load")
    p.add_argument("--api-key", default=None, help="the server's --api-key (default: $OPENAI_API_KEY)")
    if not complete:
        p.add_argument("--system", "--system-prompt", dest="system", default=None, help="a system prompt")
    p.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                   help="send MESSAGE, print the reply, and exit (vLLM's)")
    p.add_argument("--stats", action="store_true", help="print the time to the first token and tokens/s after "
                                                        "each reply (vLLM's)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=128 if complete else 512)
    args = p.parse_args(argv)
    args.complete = complete
    if complete:
        args.system = None
    import uvloop
    try:
        sys.exit(uvloop.run(repl(args)))
    except KeyboardInterrupt:       # Ctrl-C before the chat started (while the model loads)
        sys.exit(130)


if __name__ == "__main__":
    main()
