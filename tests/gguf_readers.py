"""One ``gguf.GGUFReader`` per large GGUF file for the whole test run.

Building a reader parses every metadata field into numpy views: ~790k views for Gemma 3's
262k-token vocabulary, ~590k for SmolLM2's 49k tokens and merges (about 5-10 s each on 2 cores).
A real model file is opened many times in a run: pagedllm's tokenizer build (through
transformers) and weight loader, and transformers' config and weight loading for the references.
A reader is read-only (a memory map), so one instance serves them all; the references stay
independent of pagedllm's own code (only the third-party parse is shared).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Files below this size (the GGUFs tests write: tiny, rewritten in place by the corruption tests)
# always get a fresh reader; the bundled models are 98 MB and 253 MB.
MIN_SHARED_BYTES = 16 << 20
MAX_SHARED_READERS = 2  # SmolLM2 and Gemma 3; bounds the memory held by the views


class SharedGGUFReaders:
    """A stand-in for ``gguf.GGUFReader``: read-only opens of a file of at least
    ``MIN_SHARED_BYTES`` return the reader built for the same (path, size, modification time,
    inode), the ``MAX_SHARED_READERS`` most recently used kept; anything else is passed to
    ``real``."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.readers: OrderedDict[tuple[Path, int, int, int], Any] = OrderedDict()

    def __call__(self, path: Any, mode: str = "r") -> Any:
        p = Path(path).resolve()
        st = p.stat() if p.is_file() else None
        if mode != "r" or st is None or st.st_size < MIN_SHARED_BYTES:
            return self.real(path, mode)
        key = (p, st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in self.readers:
            self.readers[key] = self.real(p, mode)
            while len(self.readers) > MAX_SHARED_READERS:
                self.readers.popitem(last=False)
        self.readers.move_to_end(key)
        return self.readers[key]

    def drop(self, path: Path) -> None:
        """Forget the readers of ``path`` (frees their memory once no one else holds them)."""
        p = Path(path).resolve()
        for key in [k for k in self.readers if k[0] == p]:
            del self.readers[key]


@contextlib.contextmanager
def shared_gguf_readers() -> Iterator[SharedGGUFReaders]:
    """Patch ``gguf.GGUFReader`` (looked up at call time by pagedllm's loader and transformers)
    with a :class:`SharedGGUFReaders` for the duration of the block."""
    import gguf

    shared = SharedGGUFReaders(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", shared)
        yield shared
