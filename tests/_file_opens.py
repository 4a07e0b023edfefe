"""Which files of a folder any process opens: Linux's inotify (``IN_OPEN``), so the files
Rust code opens (tokenizers' ``tokenizer.json``, safetensors' weights) count as Python's
``open`` does, in this process or a child."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from pathlib import Path

IN_OPEN = 0x00000020
IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class OpenRecorder:
    """``with OpenRecorder(folder) as opens: ...; opens.files()``: the paths (relative to
    ``folder``, '/'-separated) of the regular files opened in it or its subfolders since
    the recorder started. The subfolders are those that exist at the start."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._folders: dict[int, str] = {}
        self._opened: set[str] = set()
        for folder, _, _ in os.walk(self.root):
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), IN_OPEN)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")
            relative = Path(folder).relative_to(self.root).as_posix()
            self._folders[wd] = "" if relative == "." else relative + "/"

    def __enter__(self) -> OpenRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._drain()
        os.close(self._fd)

    def files(self) -> set[str]:
        self._drain()
        return set(self._opened)

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    return
                raise
            at = 0
            while at < len(data):
                wd, mask, _, size = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size:at + _EVENT.size + size].rstrip(b"\0").decode()
                at += _EVENT.size + size
                if mask & IN_OPEN and not mask & IN_ISDIR and name:
                    self._opened.add(self._folders[wd] + name)
