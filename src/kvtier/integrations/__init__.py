"""Engine integrations. Each lives in its own subpackage and imports its engine lazily.

``kvtier.integrations.vllm`` is loaded by vLLM itself through ``module_path`` /
``spec_module_path`` in ``--kv-transfer-config``; importing ``kvtier`` or
``kvtier.integrations`` never needs an engine installed.
"""
