"""The value order's check of itself: are the chains it deems held by the engine really held?

Owner thread: the scheduler thread (the prefetcher's, :mod:`kvtier.tiering.prefetch`) owns the
whole :class:`HeldOrderCheck` (the recent verdicts, ``trusted``); nothing is locked.

The prefetcher's eviction order gives up the tails of paused chains it deems the engine still
holds (its own cache above kvtier keeps them). An engine whose cache running requests or one
long prompt sweep does not hold them, which the finish-order depth cannot see: a block given up
that the engine lost comes back on demand. So each such chain's next turn is recorded (held at
that turn, or lost), and while more than ``HELD_WRONG_SHARE`` of the last
``HELD_CHECK_SAMPLES`` of them found their chain lost (once there are ``HELD_CHECK_MIN``), held
chains are not evicted first. The check goes on either way, and the order comes back once at
most ``HELD_TRUSTED_AGAIN_SHARE`` of them did: a share that hovers at the line (measured: a
16-session replay switched 6 times without this margin) does not switch the order every turn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["HELD_CHECK_MIN", "HELD_CHECK_SAMPLES", "HELD_TRUSTED_AGAIN_SHARE", "HELD_WRONG_SHARE",
           "HeldOrderCheck"]

HELD_CHECK_SAMPLES = 32       # recent next turns of chains deemed held
HELD_CHECK_MIN = 8            # fewer than this: the value order is trusted
HELD_WRONG_SHARE = 0.25       # more of them lost than this: held chains are not evicted first
HELD_TRUSTED_AGAIN_SHARE = 0.125  # ...until no more than this of them were lost


@dataclass(slots=True)
class HeldOrderCheck:
    """``trusted``: whether held chains go first among the victims; ``switches``: how often the
    check turned that off or on; ``right_blocks`` / ``wrong_blocks``: blocks the order gave up
    of chains the engine did / did not hold at their next turn (the latter: demand loads)."""

    trusted: bool = True
    switches: int = 0
    right_blocks: int = 0
    wrong_blocks: int = 0
    _recent: deque[bool] = field(default_factory=lambda: deque(maxlen=HELD_CHECK_SAMPLES))

    def record(self, held: bool, given_up: int) -> None:
        """The next turn of a chain deemed held, of which the order gave up ``given_up`` blocks:
        it was held (True) or lost (False)."""
        if held:
            self.right_blocks += given_up
        else:
            self.wrong_blocks += given_up
        recent = self._recent
        recent.append(held)
        share = HELD_WRONG_SHARE if self.trusted else HELD_TRUSTED_AGAIN_SHARE
        trusted = len(recent) < HELD_CHECK_MIN or recent.count(False) <= share * len(recent)
        if trusted != self.trusted:
            self.trusted = trusted
            self.switches += 1
