"""A real fsspec filesystem (in memory) whose writes can be made to fail or to be slow, for storage-fault tests."""

import errno
import time

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class FlakyFileSystem(MemoryFileSystem):
    protocol = "flaky"
    store: dict = {}
    pseudo_dirs = [""]
    failing = False  # writes raise "no space left on device"
    slow_s = 0.0  # each write takes this long

    def pipe_file(self, path, value, **kwargs):
        if type(self).slow_s:
            time.sleep(type(self).slow_s)
        if type(self).failing:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
