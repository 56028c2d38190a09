"""The one native part, built with the package: lmcache_remote.native._wire, the bulk data path's
receive loop (lmcache_remote/native/_wire_resp.c, with its parts _wire_io.c, _wire_send.c and
_wire_reply.c sharing _wire_resp.h) and PagedKV's row copier (_wire_rows.c), one module
(_wire.c, with the XXH3 binding in _wire_xxh3.c) from several sources that share _wire.h. It
is optional: where it cannot be compiled (no C compiler, no Python headers) the install goes
on, and the pure-Python reader (lmcache_remote/storage/wire/resp.py's RespReader), the same
protocol, is used instead (`bulk.NATIVE` says which); PagedKV then copies rows in torch /
numpy."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_remote.native._wire",
            [
                "lmcache_remote/native/_wire.c",
                "lmcache_remote/native/_wire_io.c",
                "lmcache_remote/native/_wire_reply.c",
                "lmcache_remote/native/_wire_resp.c",
                "lmcache_remote/native/_wire_rows.c",
                "lmcache_remote/native/_wire_send.c",
                "lmcache_remote/native/_wire_xxh3.c",
            ],
            depends=["lmcache_remote/native/_wire.h", "lmcache_remote/native/_wire_resp.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
