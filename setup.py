"""The one compiled part: the file tier's batch reads (``kvtier.backends.file._batchio``).

Everything else is configured in pyproject.toml. The extension is optional: where no C compiler
is found the build goes on without it, and the file tier reads through Python instead
(``kvtier.backends.file.reads``; its ``native_io_active`` gauge says which path is active).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.backends.file._batchio",
            ["src/kvtier/backends/file/_batchio.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=True,
        )
    ]
)
