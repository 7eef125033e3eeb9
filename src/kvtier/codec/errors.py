"""The frame errors: why a stored frame is refused (and the one caller error).

This module owns no state: everything here is immutable or pure and safe to call from any
thread.
"""

from __future__ import annotations

from kvtier.errors import KvtierError


class FrameError(KvtierError):
    """A stored frame is not the block that was asked for (corrupt, foreign or truncated)."""


class ForeignFrame(FrameError):
    """A frame this reader cannot judge (another key, a newer format): refused, but not proof
    of damage, so backends leave it for a writer that can read it."""


class BadMagic(FrameError):
    """The frame does not start with the kvtier magic bytes."""


class UnsupportedVersion(FrameError):
    """The frame was written by an unknown format version."""


class NewerVersion(UnsupportedVersion, ForeignFrame):
    """The frame's format version is newer than this kvtier's."""


class UnknownAlgorithm(ForeignFrame):
    """The frame's integrity algorithm is not one this kvtier knows."""


class NamespaceMismatch(FrameError):
    """The frame belongs to another namespace (model, dtype, layout, tenant ...)."""


class KeyMismatch(FrameError):
    """The frame was stored under another key."""


class LengthMismatch(FrameError):
    """The frame's payload length disagrees with the frame's actual size."""


class TruncatedFrame(FrameError):
    """The frame is shorter than its header says."""


class ChecksumMismatch(FrameError):
    """The payload (or a header byte) does not match the stored checksum."""


class AuthenticationError(FrameError):
    """The frame has no valid MAC under the reader's keys, or is keyed while the reader is not
    (or the reverse)."""


class ForeignKey(AuthenticationError, ForeignFrame):
    """The frame names a signing key that is not in the reader's key ring."""


class OutputSizeMismatch(ValueError):
    """The caller's output buffer does not have the frame's payload size.

    This is a caller error, not a frame error: the frame itself is valid (it has been verified
    before this is raised), so backends keep the stored object when they see it.
    """
