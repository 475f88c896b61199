"""``python -m tools.chat``: a terminal chat that streams the reply as it is generated.

By default it runs the engine in this process; ``--url`` talks to a running server instead.
Commands: /reset forgets the conversation, /exit (or Ctrl-D) leaves."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import AsyncIterator

SYSTEM_HINT = "Type a message and press Enter; /reset starts over, /exit leaves."


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
    if interactive:
        print(SYSTEM_HINT, file=sys.stderr)
    loop = asyncio.get_running_loop()
    try:
        while True:
            if interactive:
                print("\n> ", end="", flush=True)
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if line == "/exit":
                break
            if line == "/reset":
                messages = messages[:1] if args.system else []
                print("(conversation cleared)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            stream = (_remote_stream(session, args.url, messages, args) if session is not None
                      else _local_stream(llm, messages, params))
            reply = []
            try:
                async for piece in stream:
                    reply.append(piece)
                    print(piece, end="", flush=True)
            except RuntimeError as exc:
                print(f"\n[error: {exc}]", file=sys.stderr)
                messages.pop()
                continue
            print(flush=True)
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        if session is not None:
            await session.close()
        if llm is not None:
            await llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.chat", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    args = p.parse_args(argv)
    import uvloop
    sys.exit(uvloop.run(repl(args)))


if __name__ == "__main__":
    main()
