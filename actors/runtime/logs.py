"""Every process's logging set up one way: lines ``TIME LEVEL [node] logger: message`` at the
server's level, or a logging configuration file (vLLM's ``--log-config-file``: Python's
``logging.config.dictConfig`` schema as JSON) in every process alike. The server sets both in
its environment, which its child processes (and Ray-hosted ranks) inherit."""
from __future__ import annotations

import json
import logging
import logging.config
import os
from typing import Any

LEVEL_ENV = "TROUPE_LOG_LEVEL"            # the level every process logs at (default INFO)
CONFIG_ENV = "TROUPE_LOG_CONFIG_FILE"     # a dictConfig JSON file every process configures itself from

log = logging.getLogger("troupe.logs")


def load_config(path: str) -> dict[str, Any]:
    """A logging configuration file's dictionary; ValueError naming the file and what is wrong."""
    try:
        with open(os.path.expanduser(path)) as f:
            config = json.load(f)
    except OSError as exc:
        raise ValueError(f"--log-config-file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--log-config-file {path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "version" not in config:
        raise ValueError(f"--log-config-file {path}: expected a logging dictConfig object with a \"version\" key")
    return config


def configure(node: str, level: str | None = None, force: bool = False) -> None:
    """Set up this process's logging as node ``node``: the configuration file when one is named
    (``CONFIG_ENV``, or vLLM's VLLM_LOGGING_CONFIG_PATH), else one line per record at ``level``
    (``LEVEL_ENV`` when None, else vLLM's VLLM_LOGGING_LEVEL, else INFO); nothing with vLLM's
    VLLM_CONFIGURE_LOGGING=0.
    A file that cannot be used here (a Ray rank on a machine without it) falls back to the lines,
    saying why."""
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() == "0":
        return                            # vLLM's: the application configures logging itself
    level = (level or os.environ.get(LEVEL_ENV) or os.environ.get("VLLM_LOGGING_LEVEL") or "INFO").upper()
    path = os.environ.get(CONFIG_ENV) or os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    problem = None
    if path:
        try:
            logging.config.dictConfig(load_config(path))
            return
        except (ValueError, TypeError, AttributeError, ImportError) as exc:
            problem = str(exc)
    logging.basicConfig(level=level, force=force, format=f"%(asctime)s %(levelname)s [{node}] %(name)s: %(message)s")
    if problem:
        log.warning("the logging configuration file was not used: %s", problem)
