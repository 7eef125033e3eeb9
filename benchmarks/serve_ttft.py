"""TTFT of a real ``vllm serve`` driven by vLLM's own ``vllm bench serve`` (timed_trace).

One command (run with the vLLM venv that ``scripts/setup-vllm-venv.sh`` builds)::

    .venv-vllm/bin/python benchmarks/serve_ttft.py --json serve.json --plot serve.png

Side by side, each on a fresh server with the same requests: prefix-cache-only, vllm-fs,
kvtier-file, kvtier-redis, kvtier-file-prefetch, kvtier-redis-prefetch, kvtier-file-restart,
no-reuse-baseline, no-reuse-kvtier; and, only when named in ``--configs``, kvtier-memory (the
blocks in the engine worker's own memory: the floor of every tier's TTFT under vLLM's offloading
steps). The same as ``kvtier bench serve``; see :mod:`kvtier.bench.serve`.
"""

from __future__ import annotations

import sys

from kvtier.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
