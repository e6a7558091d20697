"""Builds the C engine as ``ucl._engine`` (gcc only). A failed build fails the install: no silent fallback."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ucl._engine",
            sources=["engine/module.c", "engine/crc32c.c", "engine/writer.c", "engine/devbench.c"],
            include_dirs=["engine"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=implicit-function-declaration"],
            libraries=["pthread"],
        )
    ]
)
