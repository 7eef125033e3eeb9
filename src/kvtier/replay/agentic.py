"""``builtin:agentic``: a seeded generator of long-context agentic coding sessions.

Pure functions; this module owns no state beyond the locals of one call.

The shape follows the published statistics of agentic-coding trace sets (the issue's targets):
64-token blocks hashed the vLLM way (only full blocks, ``floor``); input tokens per request
p10 ~ 43k, median ~ 110k, p90 ~ 300k, max ~ 900k; 45-80 requests per session; each request
extends the previous one's context (the previous prompt, its answer, tool output), except that
now and then (3 % of turns) the agent rewrites part of its context, so the ideal prefix hit
inside a session is ~ 96 %; think time between turns has a median of ~ 10 s and a long
(log-normal) tail; sessions share no block.

Model, per session: a start context ~ lognormal(median 30k tokens), a final context
~ lognormal(median 210k; stratified, one draw per equal-probability stratum, and the largest
session reaches 900k so that even a small trace has the published tail), spread over the
turns in lognormal increments. Sessions start
:data:`~kvtier.replay.sessions.SESSION_STAGGER_S` apart.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from kvtier.replay.sessions import SESSION_STAGGER_S
from kvtier.replay.trace import HashConvention, Trace, TraceRequest

BLOCK_TOKENS = 64
DEFAULT_SESSIONS = 8
MAX_GENERATED_SESSIONS = 10_000  # about 600k requests: beyond it a run would not end today
MAX_CONTEXT_TOKENS = 900_000
TURNS = (45, 80)


@dataclass(frozen=True, slots=True)
class AgenticShape:
    """The generator's parameters (defaults reproduce the published shape)."""

    start_median_tokens: float = 30_000.0
    start_sigma: float = 0.35
    final_median_tokens: float = 210_000.0
    final_sigma: float = 0.6
    increment_sigma: float = 0.8
    rewrite_probability: float = 0.03
    think_median_s: float = 10.0
    think_sigma: float = 1.3
    think_max_s: float = 1_800.0
    output_median_tokens: float = 400.0
    output_sigma: float = 1.0
    output_max_tokens: int = 32_768


def generate_trace(seed: int = 0, sessions: int = DEFAULT_SESSIONS,
                   shape: AgenticShape | None = None) -> Trace:
    """``sessions`` agentic sessions, merged by start time, each turn waiting for the last."""
    if type(sessions) is not int or sessions < 1:
        raise ValueError(f"sessions must be an integer >= 1, got {sessions!r}")
    shape = shape or AgenticShape()
    rng = np.random.default_rng(seed)
    turns: list[tuple[float, int, int, int, tuple[int, ...]]] = []  # (ms, session, k, out, ids)
    lengths: dict[tuple[int, int], int] = {}
    next_id = 0
    finals = _stratified_finals(rng, sessions, shape)
    for session in range(sessions):
        count = int(rng.integers(TURNS[0], TURNS[1] + 1))
        start = float(np.exp(rng.normal(math.log(shape.start_median_tokens), shape.start_sigma)))
        final = min(max(finals[session], start * 1.5), MAX_CONTEXT_TOKENS)
        weights = np.exp(rng.normal(0.0, shape.increment_sigma, count - 1))
        increments = weights / weights.sum() * (final - start)
        context = start
        t_ms = session * SESSION_STAGGER_S * 1000.0
        ids: list[int] = []
        for turn in range(count):
            if turn:
                context += float(increments[turn - 1])
                if rng.random() < shape.rewrite_probability:
                    del ids[int(len(ids) * rng.uniform(0.3, 1.0)):]
            tokens = min(int(context), MAX_CONTEXT_TOKENS)
            blocks = tokens // BLOCK_TOKENS
            del ids[blocks:]
            ids.extend(range(next_id, next_id + blocks - len(ids)))
            next_id = max(next_id, ids[-1] + 1) if ids else next_id
            output = int(min(shape.output_max_tokens, np.exp(
                rng.normal(math.log(shape.output_median_tokens), shape.output_sigma))))
            turns.append((t_ms, session, turn, output, tuple(ids)))
            lengths[(session, turn)] = tokens
            think = min(shape.think_max_s, float(np.exp(
                rng.normal(math.log(shape.think_median_s), shape.think_sigma))))
            t_ms += think * 1000.0  # the recorded gap between two turns' arrivals
    turns.sort(key=lambda item: (item[0], item[1], item[2]))
    position = {(session, turn): place for place, (_, session, turn, _, _) in enumerate(turns)}
    requests: list[TraceRequest] = []
    for place, (t_ms, session, turn, output, block_ids) in enumerate(turns):
        after = position[(session, turn - 1)] if turn else None
        gap = 0.0 if after is None else t_ms - requests[after].timestamp_ms
        requests.append(TraceRequest(place + 1, t_ms, lengths[(session, turn)], output,
                                     block_ids, session, after, gap))
    digest = hashlib.sha256(f"kvtier.agentic.v1:{seed}:{sessions}:{shape}".encode()).hexdigest()
    return Trace("builtin:agentic", digest, BLOCK_TOKENS, tuple(requests), 0, (), True,
                 HashConvention.FLOOR.value, sessions)


def _stratified_finals(rng: np.random.Generator, sessions: int,
                       shape: AgenticShape) -> list[float]:
    """Final context per session: one lognormal draw from each of ``sessions`` equal-probability
    strata (so even a few sessions follow the distribution), shuffled; the largest is set to
    :data:`MAX_CONTEXT_TOKENS` (the published maximum)."""
    from statistics import NormalDist

    normal = NormalDist()
    finals = [
        shape.final_median_tokens * math.exp(
            shape.final_sigma * normal.inv_cdf((index + float(rng.random())) / sessions))
        if 0 < (index + 0.5) / sessions < 1 else shape.final_median_tokens
        for index in range(sessions)
    ]
    finals[-1] = MAX_CONTEXT_TOKENS
    order = rng.permutation(sessions)
    return [min(finals[i], MAX_CONTEXT_TOKENS) for i in order]
