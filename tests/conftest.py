"""Shared pytest configuration: real servers are provided by the plugins in tests/servers/.

Every test starts with the ``kvtier`` logger as the library leaves it (no handlers, level
NOTSET, records propagating to the root logger). Importing the vLLM integration makes it
forward to the ``vllm`` logger instead (``kvtier.ops.logs.follow_host_logger``), for the rest of
the process; without this reset a test that reads ``caplog`` after a vLLM test saw each record
twice (pytest also attaches its capture handler to loggers that do not propagate).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvtier.ops.logs import LOGGER_NAME

pytest_plugins = ["servers.valkey", "servers.seaweed"]


@pytest.fixture(autouse=True)
def clean_kvtier_logger() -> Iterator[logging.Logger]:
    ours = logging.getLogger(LOGGER_NAME)
    saved = (list(ours.handlers), ours.level, ours.propagate)
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    ours.propagate = True
    yield ours
    ours.handlers[:] = saved[0]
    ours.setLevel(saved[1])
    ours.propagate = saved[2]
