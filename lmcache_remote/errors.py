"""The library's exceptions.

Every error the library raises on purpose derives from `LmcrError`, so a caller can catch one
type. Storage wraps redis-py's exceptions at its boundary (`raise BackendUnavailableError(...)
from exc`); nothing above storage ever sees a redis-py exception. `CacheEngine` itself never
lets a remote failure escape `store`, `retrieve` or `lookup`: it counts and logs it instead.
"""

from __future__ import annotations


class LmcrError(Exception):
    """Base of every lmcache-remote error."""


class ConfigError(LmcrError, ValueError):
    """A configuration value is missing, malformed or out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class KeyFormatError(LmcrError, ValueError):
    """A string is not a valid cache key (or a key field is invalid)."""


class SerdeError(LmcrError):
    """A value could not be encoded or decoded."""


class CorruptEntryError(SerdeError):
    """A stored value is damaged: a checksum, a length or a part does not agree (deleted
    where found)."""


class ForeignEntryError(SerdeError):
    """A stored value this reader does not understand (another format version, an unknown
    codec or dtype) or that is not the one its key names (chunk hash, shape, dtype, token
    count): a miss, left in place and counted apart from damage, so that engines of two
    releases can share one Redis during a rolling upgrade without erasing each other's
    values."""


class UnauthenticatedEntryError(ForeignEntryError):
    """A value a reader holding the `integrity_key` may not serve: written without the key,
    or its MAC does not verify (forged, moved under another key, written with another key).
    Like a foreign value: a miss, left in place, counted apart
    (`remote.unauthenticated_chunks`). It may be an unkeyed engine's good value in a mixed
    fleet, and deleting would protect nothing: whoever can write a value can erase one."""


class BackendError(LmcrError):
    """A storage backend failed."""


class BackendUnavailableError(BackendError):
    """The backend cannot be reached (refused, reset, down, or skipped while unhealthy)."""


class BackendTimeoutError(BackendError):
    """The backend did not answer within `remote_timeout`."""


class BackendPermissionError(BackendError):
    """The backend refused a command for lack of rights (Redis ACL NOPERM / NOAUTH)."""
