"""``kvtier replay``: trace reader, reference hit ratios, engine-step simulator and report.

Public entry points: :func:`kvtier.replay.reader.read_trace`, :func:`kvtier.replay.engine.replay`,
:mod:`kvtier.replay.reference` and :mod:`kvtier.replay.report`. This package owns no module-level
state.
"""
