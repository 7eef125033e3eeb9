"""The root of kvtier's exceptions: catch :class:`KvtierError` to catch anything kvtier raises.

Every error class in the package derives from :class:`KvtierError` (and, where callers relied
on it before, from the builtin it used to be: ``ValueError`` for bad arguments, ``RuntimeError``
for state). A component used after it was shut down raises the one :class:`ClosedError`, whose
message names the component; the older per-component names are aliases of it.
"""

from __future__ import annotations

__all__ = ["ClosedError", "KvtierError"]


class KvtierError(Exception):
    """Base class of every exception kvtier raises on purpose."""


class ClosedError(KvtierError, RuntimeError):
    """A manager, tier, lookup manager, backend, pool or I/O pool was used after shutdown."""
