"""What a store call raises: one rooted hierarchy, each message naming the URI or directory,
the cause and, where a user can act, the fix.

Invariant: a reader tells from the class alone whether retrying can help (`ObjectNotFound`:
the writer may not have finished; `StoreUnwritable.full`: someone may free space) or not
(`ObjectCorrupt`, `OutsideStore`, a read-only or foreign disk)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


class StoreError(Exception):
    """Any store failure; the message names the URI or key and the cause."""


class ObjectNotFound(StoreError):
    """The object does not exist (a reader may retry: the writer may not have finished)."""


class ObjectCorrupt(StoreError):
    """The object's bytes are not the ones its event names (size or sha256), or more than the
    config lets a reader read: reading it again gives the same, so a reader gives the version
    up instead of retrying."""


class OutsideStore(StoreError):
    """A URI outside the run's store: never read, and retrying cannot change that."""


class StoreUnwritable(StoreError):
    """The disk under the store refuses writes: full (ENOSPC, EDQUOT), read-only (EROFS) or not
    this process's to write (EACCES, EPERM). The message names the directory and the fix.
    Objects appear whole or not at all, so what was written before is intact and the failed
    write left nothing behind; writing again helps only once someone frees space or fixes the
    mount (`full` says which kind a writer may wait out)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code

    @property
    def full(self) -> bool:
        return self.code in (errno.ENOSPC, errno.EDQUOT)


_UNWRITABLE = {
    errno.ENOSPC: ("has no space left on its device", "free space there or point {setting} at a larger disk"),
    errno.EDQUOT: ("is over its disk quota", "raise the quota or point {setting} at another disk"),
    errno.EROFS: ("is on a read-only filesystem", "remount it read-write or point {setting} at a writable directory"),
    errno.EACCES: ("is not writable by this process", "give uid {uid} write access or point {setting} elsewhere"),
    errno.EPERM: ("is not writable by this process", "give uid {uid} write access or point {setting} elsewhere"),
}


def write_error(exc: OSError, what: str, directory: Path, setting: str) -> StoreError:
    """`exc`, raised while `what` into `directory`, as the error a user acts on: a
    `StoreUnwritable` naming the directory, the cause and the fix (`setting` is the config key
    that chose the directory) when the disk refuses writes, else a StoreError with the cause."""
    if exc.errno in _UNWRITABLE:
        problem, fix = _UNWRITABLE[exc.errno]
        name = errno.errorcode[exc.errno]
        return StoreUnwritable(
            f"{setting}: {directory} {problem} ({name}, {what}); "
            f"{fix.format(setting=setting, uid=os.getuid())}, then restart: nothing written before is lost",
            exc.errno,
        )
    return StoreError(f"{setting}: {what} into {directory} failed: {exc}")
