"""``troupe``: Troupe's command. ``troupe SUBCOMMAND ...`` runs the tool of that name with the
rest of the command line (``troupe serve MODEL --port 8000`` is ``python -m tools.serve MODEL
--port 8000``); ``troupe --version`` prints the package's version."""
from __future__ import annotations

import importlib
import sys
from importlib import metadata

# subcommand -> (module, what it does)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tools.serve", "the OpenAI-compatible server (vLLM's `vllm serve` flags)"),
    "chat": ("tools.chat", "chat with a model in the terminal (in-process, or a running server with --url)"),
    "complete": ("tools.complete", "complete prompts in the terminal (in-process, or a running server with --url)"),
    "batch": ("tools.batch", "run a file of requests through the engine, offline"),
    "run-batch": ("tools.batch", "vLLM's name for batch"),
    "bench": ("tools.bench.__main__", "benchmarks: offline, serve, latency, structured, tracing, ..."),
    "trace": ("tools.trace", "save a running server's trace for ui.perfetto.dev"),
    "pd-proxy": ("tools.pd_proxy", "prefill/decode disaggregation: one endpoint over prefill and decode servers"),
    "quantize": ("tools.quantize", "write an FP8 or INT8 (W8A8) compressed-tensors checkpoint of a model"),
    "detect-watermark": ("tools.detect_watermark", "whether a text carries the watermark of a --watermark-config"),
    "collect-env": ("tools.collect_env", "what a bug report needs: versions, CPU and its instruction sets, devices, "
                                         "the environment (vLLM's collect-env)"),
}
PROG = "troupe"


def version() -> str:
    try:
        return metadata.version("troupe")
    except metadata.PackageNotFoundError:
        return "unknown"


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"usage: {PROG} [-h] [--version] {{{','.join(SUBCOMMANDS)}}} ...", "",
             "Troupe: an LLM inference and serving engine built as an actor system.", "",
             "subcommands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    lines += ["", "options:", "  -h, --help  show this help message and exit",
              "  --version   print the version and exit", "",
              f"`{PROG} SUBCOMMAND --help` describes a subcommand's flags."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        sys.stderr.write(usage() + f"{PROG}: error: a subcommand is required\n")
        sys.exit(2)
    first, rest = args[0], args[1:]
    if first in ("-h", "--help"):
        sys.stdout.write(usage())
        sys.exit(0)
    if first in ("-V", "--version"):
        print(f"{PROG} {version()}")
        sys.exit(0)
    if first not in SUBCOMMANDS:
        sys.stderr.write(f"usage: {PROG} [-h] [--version] {{{','.join(SUBCOMMANDS)}}} ...\n"
                         f"{PROG}: error: unknown subcommand {first!r} (choose from {', '.join(SUBCOMMANDS)})\n")
        sys.exit(2)
    name = SUBCOMMANDS[first][0]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        sys.stderr.write(f"{PROG}: error: {first}: {name} is not part of this installation\n")
        sys.exit(1)
    prog = f"{PROG} {first}"
    code = module.main(rest, prog=prog)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
