"""``python -m tools.complete`` (``troupe complete``, vLLM's ``vllm complete``): each line typed is
a prompt, completed and streamed as it is generated, on its own (no history). The flags are
``tools.chat``'s: the engine in this process, or a running server with ``--url``; ``-q PROMPT``
completes one prompt and exits."""
from __future__ import annotations

from tools import chat


def main(argv: list[str] | None = None, prog: str = "python -m tools.complete") -> None:
    chat.main(argv, prog, complete=True)


if __name__ == "__main__":
    main()
