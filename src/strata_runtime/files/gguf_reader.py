"""``gguf.GGUFReader`` with compact metadata arrays.

gguf-py's reader parses every element of a metadata array into ndarray views
of its own (a string is two: its length and its bytes). A 262,144-token
vocabulary with its scores and types becomes ~2.1 million views, ~270 MiB of
Python objects that live as long as the reader: more than the weights of a
small model. Here an array of scalars is one ndarray over the mapped file, and
an array of strings is one region of it with the start and length of each
string; the rest (scalars, tensor infos, the tensors) is gguf-py's own parse.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

_HEADER_BYTES = 12  # an array's element type (uint32) and count (uint64)


class PackedArrayField(ReaderField):
    """A metadata array held as ``parts = [key length, key, ARRAY, element
    type, count, payload...]``, the first five as gguf-py has them.

    Invariant: for scalar elements ``parts[5]`` is the ndarray of all of them
    (``data == [5]``); for strings ``parts[5]`` and ``parts[6]`` are int64
    starts and lengths into the uint8 region ``parts[7]``, one per string
    (``data == [5, 6, 7]``). ``contents()`` answers as ``ReaderField`` does.
    """

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        if self.types[-1] != GGUFValueType.STRING:
            return self.parts[5][index_or_slice].tolist()
        starts, lengths, region = self.parts[5], self.parts[6], self.parts[7]
        if isinstance(index_or_slice, int):
            start = int(starts[index_or_slice])
            return region[start:start + int(lengths[index_or_slice])].tobytes().decode("utf-8")
        buffer = region.tobytes()  # one copy of the region, not one per string
        return [buffer[s:s + n].decode("utf-8")
                for s, n in zip(starts[index_or_slice].tolist(), lengths[index_or_slice].tolist())]


class CompactGGUFReader(GGUFReader):
    """``GGUFReader`` whose metadata arrays are ``PackedArrayField``s, parsing
    from a plain ndarray view of its memory map.

    ``np.memmap`` runs bookkeeping on every slice; a plain view of the same
    mapping does not, and the mapping stays alive as the view's base, so tensor
    data is still read lazily from the file.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain_data = mapped.view(np.ndarray)

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            key_length, key = self._get_str(offs)
            type_offs = offs + int(key_length.nbytes + key.nbytes)
            raw_type = self._get(type_offs, np.uint32)
            array_offs = type_offs + int(raw_type.nbytes)
            # An array's element type follows its type; a scalar may end the file, so read it for arrays only.
            element = self._get(array_offs, np.uint32)[0] if raw_type[0] == GGUFValueType.ARRAY else None
            if element is None or element == GGUFValueType.ARRAY:
                offs = super()._build_fields(offs, 1)  # scalars and nested arrays: gguf-py's own parse
                continue
            element = GGUFValueType(element)
            parts, size = self._packed_array(array_offs, element)
            self._push_field(PackedArrayField(offs, key.tobytes().decode("utf-8"), [key_length, key, raw_type, *parts],
                                              list(range(5, 3 + len(parts))), [GGUFValueType.ARRAY, element]),
                             skip_sum=True)
            offs = array_offs + size
        return offs

    def _packed_array(self, offs: int, element: GGUFValueType) -> tuple[list[np.ndarray], int]:
        """The array at ``offs`` (its header first) as parts, and its size in bytes."""
        element_type = self._get(offs, np.uint32)
        length = self._get(offs + 4, np.uint64)
        n = int(length[0])
        first = offs + _HEADER_BYTES
        scalar = self.gguf_scalar_to_np.get(element)
        if scalar is not None:
            values = self._get(first, scalar, n)
            if len(values) != n:
                raise ValueError(f"array of {n} elements runs past the end of the file")
            return [element_type, length, values], _HEADER_BYTES + int(values.nbytes)
        if element != GGUFValueType.STRING:
            raise ValueError(f"Unknown/unhandled array element type {element}")
        starts, lengths, end = self._string_table(first, n)
        return [element_type, length, starts, lengths, self.data[first:end]], end - offs

    def _string_table(self, offs: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Starts (relative to ``offs``) and lengths of ``n`` strings stored
        back to back from ``offs``, each after its uint64 length; and the end."""
        buffer = memoryview(self.data)
        order = "big" if (self.byte_order == "S") == np.little_endian else "little"
        size = len(buffer)
        if n > (size - offs) // 8:
            raise ValueError(f"an array of {n} strings cannot fit in the {size - offs} bytes left in the file")
        starts = np.empty(n, dtype=np.int64)
        lengths = np.empty(n, dtype=np.int64)
        position = offs
        for i in range(n):  # sequential by nature: each length says where the next begins
            if position + 8 > size:
                raise ValueError(f"string {i} of an array runs past the end of the file")
            length = int.from_bytes(buffer[position:position + 8], order)
            position += 8
            starts[i] = position - offs
            lengths[i] = length
            position += length
        if position > size:
            raise ValueError("the last string of an array runs past the end of the file")
        return starts, lengths, position
