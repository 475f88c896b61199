"""The flags of vLLM's ``vllm serve`` that Troupe's server does not implement, on its command line
(their tables, shared with the offline API's keywords, are actors/engine/vllm_options.py).

A vLLM command line runs unchanged but for the command (``troupe serve MODEL ...``): flags
Troupe implements have vLLM's names and meanings (tools/serve.py, actors/engine/args.py); the
``REFUSED`` flags are refused by name, one line on stderr and exit code 2, before anything loads::

    troupe: error: --decode-context-parallel-size is a vLLM flag Troupe does not implement: ...

A few vLLM flags ask for what Troupe always does; those are accepted (``ALWAYS``), and a few take a
value that may name what Troupe does (``VALUES``: ``--tokenizer-mode auto`` accepted,
``--tokenizer-mode mistral`` refused). vLLM gives
its boolean flags a ``--no-`` form: for a refused boolean flag, the ``--no-`` form asks for what
Troupe does anyway and is accepted."""
from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from actors.engine.vllm_options import ALIASES, ALWAYS, BOOLEAN, NEVER, REFUSED, VALUES  # noqa: F401 (the tables)


def message(flag: str, value: str | None = None) -> str:
    """The one line a refused flag gets (``flag`` as given: long, short or --no- form; ``value``,
    for a flag of ``VALUES``, the value refused)."""
    long = ALIASES.get(flag, flag)
    named = long if long == flag else f"{long} ({flag})"
    if long in VALUES:
        accepted, reason = VALUES[long]
        return (f"troupe: error: {named} {value} is a vLLM setting Troupe does not implement: {reason} "
                f"({named} {' or '.join(accepted)})")
    reason = REFUSED.get(long) or NEVER.get(long)
    return f"troupe: error: {named} is a vLLM flag Troupe does not implement" + (f": {reason}" if reason else "")


def refuse(flag: str, value: str | None = None) -> NoReturn:
    sys.stderr.write(message(flag, value) + "\n")
    sys.stderr.flush()
    raise SystemExit(2)


class _Refuse(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        refuse(option_string or self.option_strings[0])


class _Values(argparse.Action):
    """A flag of ``VALUES``: its value accepted when it names what Troupe does."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = option_string or self.option_strings[0]
        if values not in VALUES[ALIASES.get(flag, flag)][0]:
            refuse(flag, values)


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """Refuse ``REFUSED`` (and their short forms) when given; accept ``ALWAYS``, and the --no-
    forms of the refused booleans."""
    shorts: dict[str, list[str]] = {}
    for short, long in ALIASES.items():
        shorts.setdefault(long, []).append(short)
    for flag in REFUSED:
        p.add_argument(flag, *shorts.get(flag, ()), action=_Refuse, nargs="?", dest="vllm_refused",
                       help=argparse.SUPPRESS)
        if flag in BOOLEAN:
            p.add_argument("--no-" + flag[2:], action="store_true", dest="vllm_no_op", help=argparse.SUPPRESS)
    for flag in NEVER:
        p.add_argument(flag, action=_Refuse, nargs=0, dest="vllm_refused", help=argparse.SUPPRESS)
    for flag, (accepted, why) in VALUES.items():
        p.add_argument(flag, *shorts.get(flag, ()), action=_Values, dest="vllm_no_op",
                       metavar="{" + ",".join(accepted) + "}",
                       help=f"vLLM's, accepted as {' or '.join(accepted)} ({why}); any other value is refused")
    group = p.add_argument_group("vLLM flags for what Troupe always does (accepted; they change nothing)")
    for flag, why in ALWAYS.items():
        group.add_argument(flag, action="store_true", dest="vllm_no_op", help=why)
