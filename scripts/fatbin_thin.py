"""A CUDA extension made small enough to carry to the device: every payload of its fatbin (the `.nv_fatbin` section
of the ELF shared object) that is not for the kept architectures is overwritten with zeros in place, headers kept,
so the file keeps its size and layout and compresses to a fraction (vLLM 0.34.0's `_C`: 88 MB, sm_75-sm_120 cubins
and PTX; its sm_90 cubins and compute_90 PTX are 12 MB; xz: 15 MB). The CUDA driver picks an entry by the
architecture in its header and reads only that payload, so on an sm_90 GPU the extension runs the very cubins the
wheel ships; a kernel without a kept entry fails to load (loudly), it is never replaced.

Why by hand: no tool rewrites a fatbin in place (cuobjdump and nvdisasm read; nvcc's fatbinary builds from
inputs). The format read here is the one fatbinary writes: a blob header (magic 0xBA55ED50, version u16, header
size u16, payload size u64) followed by entries, each (kind u16: 1 PTX, 2 ELF cubin; u16; header size u32; payload
size u64; u32; u32; minor u16; major u16; sm arch u32; ...) and its payload right after its header.
"""
from __future__ import annotations

import lzma
import struct
from pathlib import Path
from typing import Callable, Dict, Tuple

MAGIC = 0xBA55ED50
PTX, CUBIN = 1, 2


def sections(data: bytes) -> Dict[str, Tuple[int, int]]:
    """{name: (file offset, size)} of an ELF64 little-endian file's sections."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, strndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * entsize) for i in range(count)]
    names = heads[strndx][4]
    out = {}
    for name, _, _, _, offset, size in heads:
        end = data.index(b"\0", names + name)
        out[data[names + name:end].decode()] = (offset, size)
    return out


def entries(data: bytes):
    """(entry offset, header size, payload size, kind, arch) of every fatbin entry of the file."""
    offset, size = sections(data)[".nv_fatbin"]
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _, head, payload = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:      # blobs are 8-byte aligned: padding between them
            pos += 8
            continue
        p, blob_end = pos + head, pos + head + payload
        while p < blob_end:
            kind, _, ehead, esize = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            yield p, ehead, esize, kind, arch
            p += ehead + esize
        pos = blob_end


def thin(data: bytes, keep: Callable[[int, int], bool]) -> Tuple[bytes, int, int]:
    """(data with every entry payload keep(kind, arch) refuses zeroed, bytes kept, bytes zeroed)."""
    out = bytearray(data)
    kept = zeroed = 0
    for p, ehead, esize, kind, arch in entries(data):
        if keep(kind, arch):
            kept += esize
        else:
            out[p + ehead:p + ehead + esize] = bytes(esize)
            zeroed += esize
    return bytes(out), kept, zeroed


def sm90_only(kind: int, arch: int) -> bool:
    """The H200's entries: sm_90 cubins (sm_90a among them) and compute_90 PTX."""
    return arch == 90 and kind in (PTX, CUBIN)


def pack(src: Path, dest: Path, keep: Callable[[int, int], bool] = sm90_only) -> Tuple[int, int]:
    """src thinned and xz-compressed into dest; (bytes kept, bytes zeroed)."""
    data, kept, zeroed = thin(Path(src).read_bytes(), keep)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(lzma.compress(data, preset=6))
    return kept, zeroed


def unpack(src: Path, dest: Path) -> Path:
    """The thinned extension back from its .xz (on the device, before loading it)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(lzma.decompress(Path(src).read_bytes()))
    return dest
