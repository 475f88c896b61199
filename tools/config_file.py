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
last value. A positional MODEL wins over the file's ``model``.

Also vLLM's: a JSON-object flag's keys given one at a time, with dots (``--speculative-config.method
ngram``, ``--profiler-config.torch_profiler_dir=/tmp/traces``, ``--compilation-config.pass_config.x
true``): each value is read as JSON when it is JSON, else as a size (``80g``) or as text; the keys of
one flag merge into one object, which joins the flag's own JSON text given whole (the keys win);
``--flag.key+ a,b`` gives a list."""
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
    ``--config FILE`` and its dotted keys expanded; a bad file or key is the parser's error
    (exit code 2)."""
    import sys
    try:
        argv = expand_dotted(expand_config(sys.argv[1:] if argv is None else list(argv), parser), parser)
    except ConfigFileError as exc:
        parser.error(str(exc))
    return parser.parse_args(argv)


def expand_dotted(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with its ``--flag.key[.key...] VALUE`` arguments merged into one ``--flag JSON``
    per flag (see the module's docstring), placed where the flag's first key was."""
    actions = parser._option_string_actions
    out: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if not arg.startswith("-") or "." not in name or name in actions:
            out.append(arg)
            i += 1
            continue
        flag, *keys = name.split(".")
        if flag not in actions:                     # a value such as -0.5, or an unknown flag
            out.append(arg)
            i += 1
            continue
        if not all(keys):
            raise ConfigFileError(f"{name}: an empty key")
        if "=" in arg:
            text = arg.split("=", 1)[1]
        elif i + 1 < len(argv):
            text, i = argv[i + 1], i + 1
        else:
            raise ConfigFileError(f"{name} needs a value")
        i += 1
        if keys[-1].endswith("+"):                  # --flag.key+ a,b: a list
            keys[-1] = keys[-1][:-1]
            value: Any = [_dotted_value(t) for t in text.split(",")]
        else:
            value = _dotted_value(text)
        if flag not in merged:
            merged[flag] = {}
            out += [flag, ""]                       # its JSON filled in below
        node = merged[flag]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigFileError(f"{name}: {key} is given both as a value and as an object")
        node[keys[-1]] = value
    for flag, value in merged.items():
        whole = [j for j in range(len(out) - 1) if out[j] == flag and out[j + 1] != ""] + \
                [j for j, a in enumerate(out) if a.startswith(flag + "=")]
        base: dict[str, Any] = {}
        for j in sorted(whole):                    # the flag's JSON text given whole joins the keys
            text = out[j].split("=", 1)[1] if out[j].startswith(flag + "=") else out[j + 1]
            try:
                given = json.loads(text)
            except ValueError:
                raise ConfigFileError(f"{flag} is not valid JSON: {text!r}") from None
            if not isinstance(given, dict):
                raise ConfigFileError(f"{flag} is given both whole ({text!r}) and by its keys")
            base = _merge(base, given)
        for j in sorted(whole, reverse=True):
            del out[j:j + (1 if out[j].startswith(flag + "=") else 2)]
        at = out.index(flag)
        out[at + 1] = json.dumps(_merge(base, value))
    return out


def _merge(base: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in keys.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _dotted_value(text: str) -> Any:
    """A dotted key's value: JSON, else a size like 80g (vLLM's human-readable integers), else text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    from actors.engine.args import human_readable_int
    try:
        return human_readable_int(text)
    except argparse.ArgumentTypeError:
        return text


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
