"""Entry-point plugins: the groups Troupe reads from installed packages' metadata, each loaded at
most once per process, filtered by ``TROUPE_PLUGINS`` (vLLM's ``VLLM_PLUGINS``).

    group                      loaded in                         an entry point names
    troupe.general_plugins     every process, before anything    a callable run once at start-up
    troupe.platform_plugins    each worker (its platform)        a callable -> "module:Class" or None
    troupe.logits_processors   each worker (the model runner)    a LogitsProcessor class
    troupe.endpoints           the frontend (the HTTP app)       a callable given the app's router

``TROUPE_PLUGINS``: the entry-point names to load, comma-separated, in every group; unset: all of
them; set but empty: none. A plugin that fails (its import, or its call at start-up) stops the
process with a ``PluginError`` naming it: a server never runs without a plugin it was given.
"""
from __future__ import annotations

import importlib
import logging
import os
from importlib.metadata import EntryPoint, entry_points
from typing import Any

log = logging.getLogger("troupe.plugins")

GENERAL_PLUGINS = "troupe.general_plugins"
PLATFORM_PLUGINS = "troupe.platform_plugins"
LOGITS_PROCESSORS = "troupe.logits_processors"
ENDPOINTS = "troupe.endpoints"
ENV = "TROUPE_PLUGINS"

_loaded: dict[str, dict[str, Any]] = {}      # group -> entry-point name -> what it loaded (this process)
_general_plugins_run = False                 # load_general_plugins ran them all, successfully


class PluginError(RuntimeError):
    """A plugin could not be loaded or run; the message names it and its group."""

    def __init__(self, group: str, name: str, what: str, cause: BaseException) -> None:
        super().__init__(f"plugin {name!r} ({group}) failed {what}: {type(cause).__name__}: {cause}")
        self.group, self.name = group, name


def allowed_plugins() -> set[str] | None:
    """The names ``TROUPE_PLUGINS`` lets load; None when it is unset (all of them)."""
    text = os.environ.get(ENV)
    if text is None:
        return None
    return {name.strip() for name in text.split(",") if name.strip()}


def _discover(group: str) -> list[EntryPoint]:
    """The group's entry points, one per name (a package seen twice on the path counts once)."""
    seen: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        if ep.name in seen and seen[ep.name].value != ep.value:
            log.warning("plugin name %r is declared twice in %s (%s and %s); loading the first",
                        ep.name, group, seen[ep.name].value, ep.value)
        seen.setdefault(ep.name, ep)
    return list(seen.values())


def load_plugins_by_group(group: str) -> dict[str, Any]:
    """Entry-point name -> the object it names, for the plugins of ``group`` that
    ``TROUPE_PLUGINS`` allows; imported once per process (later calls return the same)."""
    if group in _loaded:
        return _loaded[group]
    allowed = allowed_plugins()
    plugins: dict[str, Any] = {}
    for ep in _discover(group):
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            plugins[ep.name] = ep.load()
        except Exception as exc:     # whatever the plugin's import raised, it is reported by name
            raise PluginError(group, ep.name, f"to load ({ep.value})", exc) from exc
    if plugins:
        log.info("%s: loaded %s", group, ", ".join(sorted(plugins)))
    _loaded[group] = plugins
    return plugins


def call_plugins(group: str, *args: Any) -> dict[str, Any]:
    """Call every loaded plugin of ``group`` with ``args``; name -> what it returned."""
    results = {}
    for name, func in load_plugins_by_group(group).items():
        try:
            results[name] = func(*args)
        except Exception as exc:     # a plugin's own failure, reported by its name
            raise PluginError(group, name, "when called", exc) from exc
    return results


def load_general_plugins() -> None:
    """Run the general plugins, once per process; every process of the engine calls this before
    it does anything else (a plugin may register an architecture, for one). Raises PluginError."""
    global _general_plugins_run
    if _general_plugins_run:
        return
    call_plugins(GENERAL_PLUGINS)
    _general_plugins_run = True


def resolve_object(path: str, what: str) -> Any:
    """An object from "package.module.name" or "package.module:name"; ValueError naming
    ``what`` (the flag or field that gave it) when it is not importable."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"{what} {path!r}: not a fully qualified name (package.module.name)")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r}: cannot be imported ({exc})") from None


def resolve_class(path: str, what: str) -> type:
    """A class from "package.module.Class" or "package.module:Class" (see resolve_object)."""
    obj = resolve_object(path, what)
    if not isinstance(obj, type):
        raise ValueError(f"{what} {path!r}: is not a class")
    return obj


def qualified_name(cls_or_path: type | str) -> str:
    """"module:Qualname" of a class (a string is returned as it is), so it can cross processes."""
    if isinstance(cls_or_path, str):
        return cls_or_path
    return f"{cls_or_path.__module__}:{cls_or_path.__qualname__}"


def reset_for_tests(general_too: bool = True) -> None:
    """Forget what this process loaded (tests that change TROUPE_PLUGINS or the path)."""
    global _general_plugins_run
    _loaded.clear()
    if general_too:
        _general_plugins_run = False

