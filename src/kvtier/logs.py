"""Where kvtier's log records go: the host's logging, with time and level.

kvtier logs through the standard ``logging`` loggers under ``kvtier``. A library must not
configure logging for its host, so by default records propagate to the root logger. Two hosts
get help:

- the ``kvtier`` command configures the root logger itself (:func:`configure_cli_logging`):
  time, level, logger name and message on stderr;
- under vLLM, :func:`follow_host_logger` hands kvtier's records to the handlers of vLLM's own
  ``vllm`` logger (its format, its level, its ``VLLM_LOGGING_*`` settings). Without this, vLLM
  configures only ``vllm``, so kvtier's INFO lines were dropped and its warnings reached stderr
  without time or level through Python's last-resort handler.

State: the handlers and levels of the ``kvtier`` logger, set once on the importing thread.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "LOG_FORMAT", "configure_cli_logging", "follow_host_logger"]

LOGGER_NAME = "kvtier"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_cli_logging(level: str = "warning") -> None:
    """Configure the root logger for the ``kvtier`` command (stderr, time and level)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)  # no-op if the host configured it


def follow_host_logger(host: str) -> bool:
    """Send kvtier's records to the handlers of the ``host`` logger, at its level.

    Does nothing (and answers False) when ``host`` has no handlers of its own (the host left
    logging to the application) or when kvtier's logger was configured already.
    """
    host_logger = logging.getLogger(host)
    ours = logging.getLogger(LOGGER_NAME)
    if not host_logger.handlers or ours.handlers:
        return False
    for handler in host_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(host_logger.getEffectiveLevel())
    ours.propagate = False
    return True
