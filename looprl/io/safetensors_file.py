"""The safetensors file format, streamed: header parsing (`safetensors_index`, no data
read), one tensor's byte range at a time (`TensorEntry.read`), memory-mapped views of a whole
file (`read_safetensors`), and a writer that emits the header and then one tensor at a time
(`write_safetensors`).

Format (the `safetensors` library's): 8-byte little-endian header length, a JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` padded with
spaces to 8 bytes, then the raw little-endian data. Parsed here with numpy because
`safetensors.numpy` cannot load BF16, and written here because `safetensors.numpy.save_file`
needs every tensor in memory at once. F32, BF16 (`ml_dtypes.bfloat16`) and F16 are supported.
Every malformed input raises `CheckpointError` naming the file and tensor.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from looprl.errors import CheckpointError

# safetensors dtype tag <-> numpy dtype <-> looprl dtype name
_ST_TO_NP = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
             "F16": np.dtype(np.float16)}
_NAME_TO_NP = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
               "float16": np.dtype(np.float16)}
_NP_TO_NAME = {v: k for k, v in _NAME_TO_NP.items()}


def dtype_name(dtype) -> str:
    """`float32` / `bfloat16` / `float16` for a numpy/jax dtype or name; CheckpointError else."""
    try:
        dt = np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype)
    except TypeError as e:
        raise CheckpointError(f"unsupported dtype {dtype!r}") from e
    if dt not in _NP_TO_NAME:
        raise CheckpointError(f"unsupported dtype {dtype!r}; expected one of {sorted(_NAME_TO_NP)}")
    return _NP_TO_NAME[dt]


class TensorEntry(NamedTuple):
    """Where one tensor of a safetensors file lies: `path`, numpy `dtype`, `shape` and the
    absolute byte `offset` of its data."""
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    def read(self) -> np.ndarray:
        """The tensor as an owned numpy array (one read of its byte range; nothing mapped).
        Raises CheckpointError naming the file and tensor when the read fails or is short."""
        count = int(np.prod(self.shape, dtype=np.int64))
        try:
            a = np.fromfile(self.path, dtype=self.dtype, count=count, offset=self.offset)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot read tensor at byte {self.offset}: "
                                  f"{e}") from e
        if a.size != count:
            raise CheckpointError(f"{self.path}: short read at byte {self.offset}: {a.size} of "
                                  f"{count} values (the file changed while it was read?)")
        return a.reshape(self.shape)


def safetensors_index(path: str | Path) -> dict[str, TensorEntry]:
    """Parse and check one safetensors file's header: `{name: TensorEntry}`, no data read.

    Raises: CheckpointError naming the file (and tensor) when the file is missing, truncated,
      has a malformed header, an unsupported dtype, or a byte range that disagrees with the
      tensor's shape.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from e
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, expected a "
                              f"header of at least 8 bytes)")
    with open(path, "rb") as f:
        (n_header,) = struct.unpack("<Q", f.read(8))
        if 8 + n_header > size:
            raise CheckpointError(f"{path}: truncated safetensors file: header says "
                                  f"{n_header} header bytes, file has {size - 8} after the length")
        try:
            header = json.loads(f.read(n_header))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: malformed safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not a JSON object)")
    body_size = size - 8 - n_header
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry "
                                  f"{info!r}") from e
        if tag not in _ST_TO_NP:
            raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {tag}; expected "
                                  f"one of {sorted(_ST_TO_NP)}")
        dt = _ST_TO_NP[tag]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if end - begin != n_bytes:
            raise CheckpointError(f"{path}: tensor {name!r}: byte range [{begin}, {end}) holds "
                                  f"{end - begin} bytes, shape {list(shape)} {tag} needs {n_bytes}")
        if end > body_size:
            raise CheckpointError(f"{path}: truncated safetensors file: tensor {name!r} ends at "
                                  f"byte {end} of the data, file has {body_size} data bytes")
        out[name] = TensorEntry(path, dt, shape, 8 + n_header + begin)
    return out


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as read-only numpy arrays (memory-mapped views).

    Returns: `{name: array}` in the file's dtypes (float32, ml_dtypes.bfloat16 or float16).
    Raises: CheckpointError as `safetensors_index`.
    """
    return mapped_views(path, safetensors_index(path))


def mapped_views(path: str | Path, index: dict[str, TensorEntry]) -> dict[str, np.ndarray]:
    """`{name: read-only memory-mapped view}` of the tensors `index` (a `safetensors_index`
    of `path`, or part of one) locates; the header is not read again."""
    if not index:
        return {}
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, e in index.items():
        n_bytes = int(np.prod(e.shape, dtype=np.int64)) * e.dtype.itemsize
        out[name] = raw[e.offset:e.offset + n_bytes].view(e.dtype).reshape(e.shape)
    return out


def write_safetensors(path: str | Path, shapes: dict[str, tuple[tuple[int, ...], str]],
                      tensors, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file one tensor at a time (the format of the `safetensors` library:
    8-byte little-endian header length, JSON header padded with spaces to 8 bytes, raw
    little-endian data in header order).

    Args:
      shapes: `{name: (shape, dtype name)}` in the order the data is written.
      tensors: an iterable of `(name, array)` in that same order; each array is written and
        then dropped by the caller's generator, so at most one is held here.
      metadata: the header's `__metadata__` (str -> str).
    Raises: CheckpointError naming the tensor when one arrives out of order or with another
      shape or dtype than `shapes` says.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (shape, dt_name) in shapes.items():
        dt = _NAME_TO_NP[dt_name]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        tag = next(t for t, d in _ST_TO_NP.items() if d == dt)
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    names = iter(shapes)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, a in tensors:
            want = next(names, None)
            shape, dt_name = shapes.get(name, (None, None))
            if name != want or tuple(a.shape) != tuple(shape) or a.dtype != _NAME_TO_NP[dt_name]:
                raise CheckpointError(f"{path}: tensor {name!r} ({a.dtype}{list(a.shape)}) does "
                                      f"not match the header's next entry {want!r} "
                                      f"({dt_name}{list(shape) if shape else None})")
            a = np.ascontiguousarray(a)
            f.write(a.reshape(-1).view(np.uint8).data)
        if next(names, None) is not None:
            raise CheckpointError(f"{path}: fewer tensors written than the header lists")
