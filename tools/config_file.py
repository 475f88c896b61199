"""vLLM's ``--config FILE.yaml``: a command's flags from a YAML file, as ``vllm serve --config``
reads it, so a vLLM deployment's file works unchanged::

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    port: 8000
    max-num-seqs: 32                  # max_num_seqs works too
    enable-prefix-caching: false      # a boolean: --enable-prefix-caching / --no-enable-prefix-caching
    served-model-name: [a, b]         # a list: the flag with each item
    speculative-config:               # a mapping: the flag with it as JSON
      method: ngram
      num_speculative_tokens: 3

The command line wins over the file, and the file over the defaults: the file's flags are
placed before the command line's (after a positional MODEL), and a flag given twice takes its
last value. A positional MODEL wins over the file's ``model``."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any


class ConfigFileError(ValueError):
    pass


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config`` in the command's help (``parse_args`` reads it before argparse does)."""
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="vLLM's: flags from a YAML file (flag names as keys, e.g. 'max-num-seqs: 32'); "
                             "the command line's own flags win over the file's")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` over ``argv`` (the process's arguments for None) with its
    ``--config FILE`` expanded; a bad file is the parser's error (exit code 2)."""
    import sys
    try:
        argv = expand_config(sys.argv[1:] if argv is None else list(argv), parser)
    except ConfigFileError as exc:
        parser.error(str(exc))
    return parser.parse_args(argv)


def expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with its ``--config FILE`` replaced by the file's flags (``argv`` itself when it
    has none). ConfigFileError names the file and what is wrong with it."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ConfigFileError("--config is given more than once")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
            raise ConfigFileError("--config needs a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    model_in_cli = bool(rest) and not rest[0].startswith("-")
    flags = config_flags(load(path), parser, path, skip=("model",) if model_in_cli else ())
    return rest[:1] + flags + rest[1:] if model_in_cli else flags + rest


def load(path: str) -> dict[str, Any]:
    import yaml
    if not path.endswith((".yaml", ".yml")):
        raise ConfigFileError(f"--config {path}: the file must be YAML (.yaml or .yml)")
    try:
        with open(os.path.expanduser(path)) as f:
            value = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: not valid YAML ({exc})") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values, "
                              f"got a {type(value).__name__}")
    return value


def config_flags(config: dict[str, Any], parser: argparse.ArgumentParser, path: str,
                 skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags ``config`` stands for (vLLM's rules; see the module's docstring).
    A key naming no flag of ``parser`` is an error naming the file and the key."""
    actions = parser._option_string_actions
    out: list[str] = []
    for key, value in config.items():
        name = str(key).replace("_", "-").lstrip("-")
        if name in skip or value is None:
            continue
        flag = "--" + name
        action = actions.get(flag)
        if action is None:
            raise ConfigFileError(f"--config {path}: {key!r} is not a flag of this command")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif "--no-" + name in actions:
                out.append("--no-" + name)
            continue
        if isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, list):
            if action.nargs in (None, "?"):         # one value: the list as JSON (--allowed-origins)
                out += [flag, json.dumps(value)]
            elif value:
                out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out
