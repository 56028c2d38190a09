"""The one native part, built with the package: lmcache_remote._wire, the bulk data path's
receive loop (lmcache_remote/_wire.c). It is optional: where it cannot be compiled (no C
compiler, no Python headers) the install goes on, and the pure-Python reader in
lmcache_remote/storage/bulk.py, the same protocol, is used instead (`bulk.NATIVE` says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_remote._wire",
            ["lmcache_remote/_wire.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
