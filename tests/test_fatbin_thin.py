"""scripts/fatbin_thin.py on a shared object gcc builds here with a crafted `.nv_fatbin` section (two blobs, entries
of three architectures, padding between the blobs): the kept entries' payloads and every header stay byte for byte,
the others' payloads become zeros, nothing outside them changes, and pack / unpack give the thinned file back."""
from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fatbin_thin  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def entry(kind, arch, payload):
    head = struct.pack("<HHIQIIHHI", kind, 0x101, 64, len(payload), 0, 0, 8, 0, arch).ljust(64, b"\0")
    return head + payload


def blob(*ents):
    body = b"".join(ents)
    return struct.pack("<IHHQ", fatbin_thin.MAGIC, 1, 16, len(body)) + body


def build(tmp_path, section: bytes) -> Path:
    src = tmp_path / "fb.c"
    items = ", ".join(str(b) for b in section)
    src.write_text("__attribute__((section(\".nv_fatbin\"), used, aligned(8))) "
                   f"const unsigned char fatbin[{len(section)}] = {{{items}}};\n"
                   "int marker(void) { return 42; }\n")
    out = tmp_path / "fb.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


def test_only_the_kept_payloads_survive(tmp_path):
    pay = {(2, 90): b"\x11" * 40, (2, 100): b"\x22" * 24, (1, 80): b"\x33" * 16, (1, 90): b"\x44" * 8}
    first = blob(entry(2, 90, pay[2, 90]), entry(2, 100, pay[2, 100]))
    second = blob(entry(1, 80, pay[1, 80]), entry(1, 90, pay[1, 90]))
    section = first + bytes(-len(first) % 8 + 8) + second        # padding between blobs
    so = build(tmp_path, section)
    data = so.read_bytes()
    found = [(kind, arch) for _, _, _, kind, arch in fatbin_thin.entries(data)]
    assert found == [(2, 90), (2, 100), (1, 80), (1, 90)]
    thinned, kept, zeroed = fatbin_thin.thin(data, fatbin_thin.sm90_only)
    assert (kept, zeroed) == (48, 40) and len(thinned) == len(data)
    changed = [i for i, (a, b) in enumerate(zip(data, thinned)) if a != b]
    for p, head, size, kind, arch in fatbin_thin.entries(data):
        body = thinned[p + head:p + head + size]
        assert thinned[p:p + head] == data[p:p + head]
        assert body == (pay[kind, arch] if arch == 90 else bytes(size))
    zero_spans = [(p + h, p + h + s) for p, h, s, k, a in fatbin_thin.entries(data) if a != 90]
    assert changed and all(any(lo <= i < hi for lo, hi in zero_spans) for i in changed)
    packed = tmp_path / "fb.so.xz"
    assert fatbin_thin.pack(so, packed) == (48, 40) and packed.stat().st_size < len(data)
    assert fatbin_thin.unpack(packed, tmp_path / "back.so").read_bytes() == thinned


def test_not_an_elf_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not an ELF64"):
        fatbin_thin.sections(b"MZ" + bytes(100))
