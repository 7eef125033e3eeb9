"""The one compiled part: the file tier's batch calls (``kvtier.backends.file._batchio``), with
the xxHash library (BSD-2-Clause, vendored in ``src/kvtier/backends/file/xxhash/``) compiled in
for the stores that seal their trailers natively.

Everything else is configured in pyproject.toml. The extension is optional: where no C compiler
is found the build goes on without it, and the file tier reads and writes through Python instead
(``kvtier.backends.file.reads``; its ``native_io_active`` gauge says which path is active).
"""

from setuptools import Extension, setup

_FILE_TIER = "src/kvtier/backends/file"

setup(
    ext_modules=[
        Extension(
            "kvtier.backends.file._batchio",
            [f"{_FILE_TIER}/_batchio.c", f"{_FILE_TIER}/_xxh3.c", f"{_FILE_TIER}/_xxh3_avx2.c"],
            include_dirs=[_FILE_TIER],
            depends=[f"{_FILE_TIER}/_xxh3.h", f"{_FILE_TIER}/xxhash/xxhash.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=True,
        )
    ]
)
