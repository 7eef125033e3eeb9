"""``python -m kvtier.cli``: the ``kvtier`` command."""

from __future__ import annotations

from kvtier.cli import run_command

run_command()
