"""Which of a vLLM tier's hits are worth loading: the runs of keys each request asks the tier.

vLLM asks a secondary tier one chunk key at a time, in prefix order, and only for the keys its
primary (CPU) tier lacks; a hit answered HIT is promoted at once. So the tier judges each hit
on the run of keys the request has asked it so far (vLLM's first scan of a request asks every
key while the answers are pending, so the run is usually the whole remaining prefix by the time
a verdict comes): a key is taken while its position in the run is below what
:meth:`~kvtier.tiering.tier.SecondaryTier.blocks_worth_loading` allows for the run, and
answered absent otherwise (counted once per request and key as declined). The rule itself is
:func:`kvtier.tiering.payoff.blocks_worth_loading`; this module only keeps the runs.

Thread ownership: a :class:`LoadGate` belongs to one ``KvtierTier`` and to vLLM's scheduler
thread (``lookup``, ``on_request_finished``): ``_runs`` (request id -> its keys asked, in
order) and ``_declined`` (request id -> keys already counted as declined).
"""

from __future__ import annotations

from kvtier.tiering.tier import SecondaryTier

__all__ = ["LoadGate"]


class LoadGate:
    """Per request, the run of keys asked of one tier, and the pay-off verdict on its hits."""

    __slots__ = ("_block_bytes", "_declined", "_runs", "_tier")

    def __init__(self, tier: SecondaryTier, block_bytes: int) -> None:
        self._tier = tier
        self._block_bytes = block_bytes
        self._runs: dict[str, dict[bytes, int]] = {}
        self._declined: dict[str, set[bytes]] = {}

    def asked(self, req_id: str, key: bytes) -> None:
        """``req_id`` asked this tier for ``key`` (whatever the answer): the run grows."""
        run = self._runs.setdefault(req_id, {})
        run.setdefault(key, len(run))

    def admits(self, req_id: str, key: bytes) -> bool:
        """Whether a hit on ``key`` (already :meth:`asked`) is worth loading for ``req_id``."""
        run = self._runs.get(req_id, {})
        position = run.get(key, 0)
        if position < self._tier.blocks_worth_loading(max(1, len(run)), self._block_bytes):
            return True
        declined = self._declined.setdefault(req_id, set())
        if key not in declined:
            declined.add(key)
            self._tier.count_declined(1)
        return False

    def forget(self, req_id: str) -> None:
        """``req_id`` finished: its run is over."""
        self._runs.pop(req_id, None)
        self._declined.pop(req_id, None)
