"""A real fsspec filesystem (in memory) whose writes can be made to fail or to be slow, for storage-fault tests."""

import errno
import time

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class FlakyFileSystem(MemoryFileSystem):
    protocol = "flaky"
    store: dict = {}
    pseudo_dirs = [""]
    failing = False  # writes raise "no space left on device" (or this exception, if it is one)
    slow_s = 0.0  # each write takes this long
    slow_s_per_mb = 0.0  # and this much longer per MiB written (a slow link)
    stored_bytes = 0  # bytes written so far: what the "storage" holds, in this process's memory
    fail_shard_writes = 0  # the next this many writes of shards fail (a transient outage), then they work
    attempts: list = []  # (path, time.monotonic(), written) of every shard write
    hold = None  # a threading.Event: while it is not set, every write waits for it (storage that does not answer)

    def pipe_file(self, path, value, **kwargs):
        cls = type(self)
        if "/shards/" in path and cls.fail_shard_writes > 0:
            cls.fail_shard_writes -= 1
            cls.attempts.append((path, time.monotonic(), False))
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (injected)")
        if "/shards/" in path:
            cls.attempts.append((path, time.monotonic(), not cls.failing))
        if cls.hold is not None:
            cls.hold.wait()
        if cls.slow_s or cls.slow_s_per_mb:
            time.sleep(cls.slow_s + cls.slow_s_per_mb * len(value) / (1 << 20))
        if cls.failing:
            error = cls.failing if isinstance(cls.failing, BaseException) else OSError(
                errno.ENOSPC, "No space left on device (injected)")
            raise type(error)(*error.args)  # a fresh one each time
        out = super().pipe_file(path, value, **kwargs)  # kept as given: BytesIO shares the bytes object
        cls.stored_bytes += len(value)
        return out


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
