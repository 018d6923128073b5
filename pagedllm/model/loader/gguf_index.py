"""A cached index of a GGUF file: its metadata and tensor table, saved after the first open.

``gguf.GGUFReader`` parses every metadata value into numpy views of the memory map, one view per
array element. The vocabulary arrays make that slow: on one Zen 3 core it takes 5 s for
SmolLM2's 49k tokens and merges and ~55 s for Gemma 3's 262k tokens. The weights, by contrast,
are a few hundred slices of the map. So the first open builds the reader as before, and
:func:`save_index` writes what the loader reads from it: every metadata value (the length alone
of arrays longer than :data:`MAX_CACHED_ARRAY`) and each tensor's name, type, shape and offset.
Later opens of the unchanged file (:func:`load_index`) rebuild the library's own
``ReaderTensor`` tuples over a fresh memory map in milliseconds. A value that was not kept, such
as a vocabulary array's contents, makes the index build the real reader then and there, so
callers see the reader's behaviour either way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
MAX_CACHED_ARRAY = 4096  # longer metadata arrays (vocabularies, merges) keep only their length

# Element dtypes of the unquantized tensor types (gguf.GGUFReader._build_tensors); every other
# type is bytes, shaped by gguf.quant_shape_to_byte_shape.
_PLAIN_DTYPES = {
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
    "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip


def index_path(gguf_path: str | os.PathLike[str]) -> Path:
    """Where the index of ``gguf_path`` is kept: ``<pagedllm cache>/gguf_index/<key>.json``, the
    key hashing the file's resolved path, size, modification time (ns) and inode, the gguf
    library's version and :data:`INDEX_VERSION` (a replaced file gets a fresh entry)."""
    from importlib.metadata import version

    from pagedllm.model.loader.tokenizer import file_cache_key, pagedllm_cache_dir

    inode = str(Path(gguf_path).resolve().stat().st_ino)
    key = file_cache_key(gguf_path, inode, f"gguf {version('gguf')}", f"v{INDEX_VERSION}")
    return pagedllm_cache_dir() / "gguf_index" / f"{key[:20]}.json"


class IndexedField:
    """One metadata value of an index, with the two parts of ``gguf.ReaderField`` the loader
    uses: ``contents()`` and ``len(data)`` (the element count of an array, 1 for a scalar).

    ``contents()`` of an array longer than :data:`MAX_CACHED_ARRAY` opens the file with
    ``gguf.GGUFReader`` (slow, once per index) and returns the reader's value.
    """

    def __init__(self, index: GGUFIndex, key: str, length: int, value: Any, kept: bool) -> None:
        self._index, self._key, self._value, self._kept = index, key, value, kept
        self.data = range(length)

    def contents(self) -> Any:
        if self._kept:
            return self._value
        return self._index.reader().fields[self._key].contents()


class GGUFIndex:
    """What the loader reads of a ``gguf.GGUFReader`` (``fields``, ``tensors``), from an index.

    Attributes:
        path: the GGUF file.
        fields: metadata key -> :class:`IndexedField`.
        tensors: ``gguf.ReaderTensor`` per tensor, in file order, whose ``data`` are views of a
            read-only memory map of the file (``field`` is None).
    """

    def __init__(self, path: Path, entry: dict[str, Any]) -> None:
        from gguf import GGMLQuantizationType, ReaderTensor, quant_shape_to_byte_shape

        self.path = path
        self._reader: Any = None
        self.fields = {
            key: IndexedField(self, key, f["len"], f.get("value"), "value" in f)
            for key, f in entry["fields"].items()
        }
        mm = np.memmap(path, mode="r")
        self.tensors = []
        for t in entry["tensors"]:
            qtype = GGMLQuantizationType[t["type"]]
            dims = np.array(t["shape"], dtype=np.uint32)
            np_dims = tuple(reversed(t["shape"]))
            dtype = _PLAIN_DTYPES.get(qtype.name)
            if dtype is None:
                dtype, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, qtype)
            raw = mm[t["offset"] : t["offset"] + t["n_bytes"]]
            if raw.nbytes != t["n_bytes"]:
                raise ValueError(f"tensor {t['name']!r} data is truncated")
            self.tensors.append(ReaderTensor(
                name=t["name"], tensor_type=qtype, shape=dims, n_elements=t["n_elements"],
                n_bytes=t["n_bytes"], data_offset=t["offset"],
                data=raw.view(dtype).reshape(np_dims), field=None,  # type: ignore[arg-type]
            ))  # fmt: skip

    def reader(self) -> Any:
        """The file's real ``gguf.GGUFReader``, built on first use."""
        if self._reader is None:
            import gguf

            self._reader = gguf.GGUFReader(self.path)
        return self._reader


def _entry(reader: Any) -> dict[str, Any]:
    """The JSON form of what :class:`GGUFIndex` serves, from a built reader."""
    from gguf import GGUFValueType

    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the header (version, counts): not metadata
        length = len(field.data)
        f: dict[str, Any] = {"len": length}
        if not (field.types and field.types[0] == GGUFValueType.ARRAY and length > MAX_CACHED_ARRAY):
            f["value"] = field.contents()
        fields[key] = f
    tensors = [
        {
            "name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
            "n_elements": int(t.n_elements), "n_bytes": int(t.n_bytes), "offset": int(t.data_offset),
        }  # fmt: skip
        for t in reader.tensors
    ]
    return {"fields": fields, "tensors": tensors}


def load_index(gguf_path: str | os.PathLike[str]) -> GGUFIndex | None:
    """The cached index of ``gguf_path``, or None when there is none (or it cannot be read: a
    damaged entry is removed and the caller builds the reader)."""
    try:
        where = index_path(gguf_path)
        if not where.is_file():
            return None
        return GGUFIndex(Path(gguf_path), json.loads(where.read_text()))
    except Exception as exc:  # noqa: BLE001 - any damage: fall back to the reader
        logger.warning("ignoring the GGUF index of %s (%s)", gguf_path, exc)
        with contextlib.suppress(OSError):
            index_path(gguf_path).unlink(missing_ok=True)
        return None


def save_index(gguf_path: str | os.PathLike[str], reader: Any) -> None:
    """Write the index of ``gguf_path`` from its built ``reader``: to a temporary file renamed
    into place, so a concurrent reader never sees half of it. Native-byte-order files only. A
    failure (read-only home, full disk, a value JSON cannot hold) only means the next open
    builds the reader again."""
    try:
        if getattr(reader, "byte_order", "I") != "I":
            return
        where = index_path(gguf_path)
        text = json.dumps(_entry(reader))
        where.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=where.name + ".", dir=where.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, where)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as exc:  # noqa: BLE001 - caching is an optimisation
        logger.debug("GGUF index of %s not saved: %s", gguf_path, exc)
