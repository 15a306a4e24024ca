"""A real local filesystem under the fsspec protocol `outage://` that fails every call while a marker file
exists (its path in TRIPWIRE_TEST_OUTAGE): a storage outage, switched on and off by a test from outside the
process that reads (run it with `python -c "import outagefs; ..."`)."""

import errno
import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

MARKER_ENV = "TRIPWIRE_TEST_OUTAGE"


class OutageFileSystem(LocalFileSystem):
    protocol = "outage"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len("outage://"):] if path.startswith("outage://") else path)

    def _check(self):
        marker = os.environ.get(MARKER_ENV)
        if marker and os.path.exists(marker):
            raise OSError(errno.EIO, "Input/output error (injected storage outage)")

    def ls(self, path, detail=False, **kwargs):
        self._check()
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        self._check()
        return super().info(path, **kwargs)

    def exists(self, path, **kwargs):
        self._check()
        return super().exists(path, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._check()
        return super().cat_file(path, start=start, end=end, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        self._check()
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("outage", OutageFileSystem, clobber=True)
