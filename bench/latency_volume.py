"""A folder served again, read-only, through FUSE with a fixed delay on every read request:
a stand-in for a network volume (NFS, Lustre, a cloud file share), where each read is a
round trip, for bench/weight_readers.py's read-ahead ways.

    python bench/latency_volume.py SOURCE MOUNTPOINT [--delay-ms 1] [--max-read-kib 1024]

Needs libfuse2 (Debian: ``apt-get install libfuse2``) and ``fusepy`` in the Python that
runs it (``pip install fusepy``; neither is a kvledger dependency), and /dev/fuse. It stays
in the foreground until unmounted (``fusermount -u MOUNTPOINT`` or ``umount``) or killed.
Each read request the kernel sends (at most ``--max-read-kib``, as an NFS mount's
``rsize``) waits ``--delay-ms`` (an NFS round trip in one data centre is 0.2-1 ms) before
it is answered from SOURCE; requests are served in parallel threads, as a network server
answers several at once, so throughput grows with the reads in flight, as it does there.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import time


def serve(source: str, mountpoint: str, delay_s: float, max_read: int) -> None:
    from fuse import FUSE, FuseOSError, Operations  # fusepy

    class Delayed(Operations):
        def _path(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def getattr(self, path, fh=None):
            try:
                st = os.lstat(self._path(path))
            except OSError as exc:
                raise FuseOSError(exc.errno) from None
            attrs = {key: getattr(st, key) for key in (
                "st_atime", "st_ctime", "st_mtime", "st_gid", "st_uid", "st_nlink", "st_size")}
            attrs["st_mode"] = st.st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
            return attrs

        def readdir(self, path, fh):
            return [".", "..", *os.listdir(self._path(path))]

        def open(self, path, flags):
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise FuseOSError(errno.EROFS)
            return os.open(self._path(path), os.O_RDONLY)

        def read(self, path, size, offset, fh):
            time.sleep(delay_s)
            return os.pread(fh, size, offset)

        def release(self, path, fh):
            os.close(fh)

    # kernel_cache: pages read stay cached across opens, as an NFS client keeps them while
    # the file's attributes are unchanged (close-to-open consistency)
    FUSE(Delayed(), mountpoint, foreground=True, ro=True, nothreads=False, kernel_cache=True,
         max_read=max_read, max_readahead=max_read)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--delay-ms", type=float, default=1.0)
    parser.add_argument("--max-read-kib", type=int, default=1024)
    args = parser.parse_args()
    serve(os.path.abspath(args.source), args.mountpoint, args.delay_ms / 1000,
          args.max_read_kib * 1024)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
