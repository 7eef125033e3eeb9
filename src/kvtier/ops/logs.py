"""Where kvtier's log records go: the host's logging, with time and level.

kvtier logs through the standard ``logging`` loggers under ``kvtier``. A library must not
configure logging for its host, so by default records propagate to the root logger. Two hosts
get help:

- the ``kvtier`` command configures the root logger itself (:func:`configure_cli_logging`):
  time, level, logger name and message on stderr;
- under vLLM, :func:`follow_host_logger` hands kvtier's records to vLLM's own ``vllm`` logger
  (its handlers, format and level, its ``VLLM_LOGGING_*`` settings). Without this, vLLM
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


class _ToHostLogger(logging.Handler):
    """Hands each record to the host logger as if it had been logged there: the host's
    filters, handlers, formatters and level apply, whenever the host (re)configures them."""

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host

    def emit(self, record: logging.LogRecord) -> None:
        host = logging.getLogger(self.host)
        if host.isEnabledFor(record.levelno):
            host.handle(record)


def follow_host_logger(host: str) -> bool:
    """Send kvtier's records through the ``host`` logger (vLLM: ``"vllm"``).

    The host may configure its logging before or after this call (vLLM does it when an engine
    starts). kvtier's own level becomes INFO (or the host's, if lower at this moment), so DEBUG
    records cost nothing unless asked for. Answers False, changing nothing, when kvtier's logger
    has handlers already (the application configured it, or this ran before).
    """
    ours = logging.getLogger(LOGGER_NAME)
    if ours.handlers:
        return False
    ours.addHandler(_ToHostLogger(host))
    ours.setLevel(min(logging.INFO, logging.getLogger(host).getEffectiveLevel()))
    ours.propagate = False
    return True
