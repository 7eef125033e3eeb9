"""Values read from a tier reach the terminal as plain text: no markup, no control characters.

A neighbour who can write a namespace manifest chooses its model name; `kvtier usage` and the
table `kvtier purge` shows before asking must print it as written, escaped, and never crash.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.backends import open_backend
from kvtier.keys import Namespace, chain_keys
from kvtier.text import printable

HOSTILE = ["[/]", "org/model[/x]", "[link=https://evil.example]click[/link]",
           "\x1b[2J\x1b[Hfake table", "\x1b]0;owned\x07title", "carriage\rreturn"]


def _store(root: Path, model: str) -> None:
    namespace = Namespace(model=model)
    backend = open_backend(f"file://{root}", namespace)
    keys = chain_keys(list(range(16)), 16, namespace)
    backend.put_many(keys, [bytes(32)])
    backend.close()


@pytest.mark.parametrize("command", [["usage"], ["purge", "--dry-run", "--namespace",
                                                 "block_size=0"]])
def test_usage_and_purge_show_hostile_model_names_escaped(tmp_path: Path,
                                                          command: list[str]) -> None:
    """Before: '[/]' crashed usage with a MarkupError; escapes reached the terminal raw."""
    for model in HOSTILE:
        _store(tmp_path, model)
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", command[0], f"file://{tmp_path}", *command[1:]],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "COLUMNS": "200", "TERM": "xterm"},
    )
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout and "\r" not in done.stdout
    assert "[/]" in done.stdout and "org/model[/x]" in done.stdout
    assert "[link=https://evil.example]click[/link]" in done.stdout
    assert "\\x1b[2J" in done.stdout  # shown, escaped


def test_printable_escapes_only_what_is_not_printable() -> None:
    assert printable("org/model[/x]") == "org/model[/x]"
    assert printable("a\x1b[2Jb\x00") == "a\\x1b[2Jb\\x00"
    assert printable(42) == "42"
