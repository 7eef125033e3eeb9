"""The local-disk tier: one framed file per block (:mod:`.backend`; a frame's reads and writes
in :mod:`.frameio`, the scan at open in :mod:`.scan`), its capacity index (:mod:`.capacity`)
and its kind with the inventory (:mod:`.kind`)."""

from kvtier.backends.file.backend import SETTINGS, FileBackend, from_url
from kvtier.backends.file.layout import DirectIO

__all__ = ["SETTINGS", "DirectIO", "FileBackend", "from_url"]
