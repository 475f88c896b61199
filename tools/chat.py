"""``python -m tools.chat``: a terminal chat that streams the reply as it is generated.

By default it runs the engine in this process; ``--url`` talks to a running server instead.
Ctrl-C while a reply streams stops it: the request is aborted (the output iterator is closed;
with ``--url``, the HTTP response), the part already shown stays in the conversation as the
assistant's turn, and the prompt comes back. Ctrl-C at the prompt clears the line; /exit or
Ctrl-D leaves. /help lists the commands."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from contextlib import aclosing
from typing import AsyncIterator

COMMANDS = {
    "/help": "list these commands",
    "/history": "show the conversation so far",
    "/reset": "forget the conversation (the --system prompt stays)",
    "/exit": "leave (so does Ctrl-D)",
}
SYSTEM_HINT = ("Type a message and press Enter; Ctrl-C stops a reply, /help lists the commands, "
               "/exit leaves.")
STOPPED = "[stopped]"


async def _local_stream(llm, messages, params) -> AsyncIterator[str]:
    async for out in llm.chat(messages, params):
        if out.error:
            raise RuntimeError(out.error)
        if out.text:
            yield out.text


async def _remote_stream(session, url, messages, args) -> AsyncIterator[str]:
    body = {"messages": messages, "stream": True, "temperature": args.temperature,
            "max_tokens": args.max_tokens}
    async with session.post(f"{url.rstrip('/')}/v1/chat/completions", json=body) as resp:
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
                for choice in event["choices"]:
                    text = choice["delta"].get("content")
                    if text:
                        yield text
        except BaseException:
            resp.close()          # the server sees the client leave and aborts the request
            raise


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


def command(line: str, messages: list[dict[str, str]], system: str | None) -> bool:
    """Run a /command; False for /exit."""
    if line == "/exit":
        return False
    if line == "/reset":
        messages[:] = messages[:1] if system else []
        print("(conversation cleared)", file=sys.stderr)
    elif line == "/history":
        for m in messages:
            print(f"{m['role']}: {m['content']}")
    elif line == "/help":
        for name, what in COMMANDS.items():
            print(f"{name:<10} {what}")
        print("Ctrl-C     stop the reply being written (at the prompt: clear the line)")
    else:
        print(f"unknown command {line}; /help lists the commands", file=sys.stderr)
    return True


async def repl(args: argparse.Namespace) -> int:
    from actors.api import AsyncLLM, SamplingParams
    session = llm = None
    if args.url:
        import aiohttp
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    else:
        print("loading the model...", file=sys.stderr, flush=True)
        llm = await AsyncLLM.create(args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    loop = asyncio.get_running_loop()
    interrupts = Interrupts(interactive)
    loop.add_signal_handler(signal.SIGINT, interrupts)
    reader = LineReader(loop)
    if interactive:
        print(SYSTEM_HINT, file=sys.stderr)
    try:
        while True:
            if interactive:
                print("\n> ", end="", flush=True)
            line = await reader.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not command(line, messages, args.system):
                    break
                continue
            messages.append({"role": "user", "content": line})
            stream = (_remote_stream(session, args.url, messages, args) if session is not None
                      else _local_stream(llm, messages, params))
            try:
                reply, stopped = await stream_reply(stream, interrupts)
            except Exception as exc:        # a failed request ends the turn, not the chat
                print(f"\n[error: {exc}]", file=sys.stderr)
                messages.pop()
                continue
            if stopped:
                print(f"\n{STOPPED}", file=sys.stderr, flush=True)
            else:
                print(flush=True)
            messages.append({"role": "assistant", "content": reply})
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if session is not None:
            await session.close()
        if llm is not None:
            await llm.shutdown()
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m tools.chat") -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    args = p.parse_args(argv)
    import uvloop
    try:
        sys.exit(uvloop.run(repl(args)))
    except KeyboardInterrupt:       # Ctrl-C before the chat started (while the model loads)
        sys.exit(130)


if __name__ == "__main__":
    main()
