"""A GGUF file's header walked against the file's size before any library reads it (issue 49).

gguf-py's reader (which transformers uses) allocates every metadata array the header declares: a 49-byte file
whose one array claims 2^40 elements makes it allocate without bound (or transformers raise a traceback
from deep inside). :func:`check_gguf` walks the header — magic, version, counts, every key, value and array,
every tensor record — seeking over payloads without reading them, and checks each declared length against
the bytes the file still has. A file that passes can still be a model transformers cannot map; one that
fails gets a one-line :class:`~cast_llm.errors.CastError` naming the file and what is wrong.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): ``"GGUF"``, uint32 version (2 or 3;
1 used 32-bit counts), uint64 tensor count, uint64 metadata count; each metadata entry is a string key
(uint64 length + bytes), a uint32 type and a value; an array is a uint32 item type, a uint64 count and the
items; each tensor record is a name string, a uint32 dimension count, that many uint64 dimensions, a uint32
type and a uint64 offset. All little-endian.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from cast_llm.errors import CastError

# value type -> fixed size in bytes (8: string, 9: array are variable)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_DIMS = 8  # GGML_MAX_DIMS is 4; a little room
MAX_DEPTH = 4  # arrays of arrays: none in practice


class _Bad(Exception):
    pass


class _Reader:
    def __init__(self, f, size: int, count_size: int):
        self.f, self.size, self.count_size = f, size, count_size

    @property
    def left(self) -> int:
        return self.size - self.f.tell()

    def read(self, n: int) -> bytes:
        if n > self.left:
            raise _Bad(f"the header declares {n:,} more bytes at offset {self.f.tell():,}, but the file ends "
                       f"{self.left:,} bytes later")
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n > self.left:
            raise _Bad(f"{what} declares {n:,} bytes at offset {self.f.tell():,}, but the file has only "
                       f"{self.left:,} left")
        self.f.seek(n, os.SEEK_CUR)

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def count(self) -> int:
        return struct.unpack("<Q" if self.count_size == 8 else "<I", self.read(self.count_size))[0]

    def string(self, what: str) -> None:
        self.skip(self.count(), what)

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in _FIXED:
            self.skip(_FIXED[vtype], what)
        elif vtype == STRING:
            self.string(what)
        elif vtype == ARRAY:
            if depth >= MAX_DEPTH:
                raise _Bad(f"{what} nests arrays deeper than {MAX_DEPTH}")
            itype, n = self.u32(), self.count()
            smallest = _FIXED.get(itype, self.count_size if itype == STRING else 4 + self.count_size)
            if itype not in _FIXED and itype not in (STRING, ARRAY):
                raise _Bad(f"{what} is an array of unknown type {itype}")
            if n * smallest > self.left:  # before a single item is read: a 2^40-element claim ends here
                raise _Bad(f"{what} claims {n:,} items ({n * smallest:,} bytes at least), but the file has only "
                           f"{self.left:,} bytes left")
            if itype in _FIXED:
                self.skip(n * _FIXED[itype], what)
            else:
                for _ in range(n):
                    self.value(itype, what, depth + 1)
        else:
            raise _Bad(f"{what} has unknown value type {vtype}")


def check_gguf(path: str | Path) -> None:
    """Raise a one-line CastError unless every length in the GGUF header of ``path`` fits in the file."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CastError(f"{p} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model file")
            r = _Reader(f, size, 8)
            version = r.u32()
            if version not in (1, 2, 3):
                raise CastError(f"{p}: GGUF version {version} is not one this reader knows (1-3)")
            r.count_size = 4 if version == 1 else 8
            n_tensors, n_kv = r.count(), r.count()
            if n_kv * (r.count_size + 4 + 1) > r.left or n_tensors * (r.count_size + 4 + 4 + 8) > r.left:
                raise _Bad(f"the header declares {n_kv:,} metadata entries and {n_tensors:,} tensors, more than "
                           f"its {size:,} bytes can hold")
            for i in range(n_kv):
                r.string(f"metadata key {i}")
                r.value(r.u32(), f"metadata entry {i}")
            for i in range(n_tensors):
                r.string(f"tensor {i}'s name")
                dims = r.u32()
                if dims > MAX_DIMS:
                    raise _Bad(f"tensor {i} declares {dims} dimensions")
                r.skip(dims * 8 + 4, f"tensor {i}'s shape")
                offset = struct.unpack("<Q", r.read(8))[0]
                if offset > size:
                    raise _Bad(f"tensor {i}'s data starts at byte {offset:,}, past the end of the file ({size:,})")
    except _Bad as e:
        raise CastError(f"{p} is not a valid GGUF file: {e}; pass an intact .gguf model file") from None
    except struct.error:
        raise CastError(f"{p} is not a valid GGUF file: its header is cut short; pass an intact .gguf model file") \
            from None
    except OSError as e:
        raise CastError(f"{p} cannot be read: {e.strerror or e}") from None
