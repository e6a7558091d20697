"""Builds the C engine as ``ucl._engine`` (gcc only). A failed build fails the install: no silent fallback."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ucl._engine",
            sources=["engine/module.c", "engine/crc32c.c", "engine/writer.c", "engine/reader.c", "engine/devbench.c"],
            include_dirs=["engine"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=implicit-function-declaration"],
            libraries=["pthread"],
        ),
        # Delta chunk codec (spec/delta.md), a separate module so it builds and tests on its own. Links the
        # system's libzstd.so.1 (present wherever apt/dpkg is; no zstd.h needed: delta.c declares the few
        # stable entry points it uses).
        Extension(
            "ucl._delta",
            sources=["engine/delta.c"],
            include_dirs=["engine"],
            define_macros=[("UCL_DELTA_PYTHON", "1")],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=implicit-function-declaration"],
            extra_link_args=["-l:libzstd.so.1", "-lm"],
        ),
    ]
)
