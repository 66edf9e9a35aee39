"""An AOT folder's manifest.json: read, checked against jit/schema/aot_manifest.schema.json.

Used by the loader (which trusts nothing in a folder it did not write) and by aot.py (which adds
to an existing manifest). Every problem is a ManifestError naming the file and the field.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

from . import roots
from .errors import ManifestError
from .schema_check import validate

MANIFEST_FORMAT = 2  # 2: entries list the files their compiler read ("files")


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    with open(roots.schema_dir() / "aot_manifest.schema.json") as f:
        return json.load(f)


def _field(data, path: list) -> str:
    """'modules/3 (name): file' style: the JSON path, with the entry's module name when known."""
    if not path:
        return "(top level)"
    if len(path) >= 2 and path[0] == "modules" and isinstance(path[1], int):
        try:
            name = data["modules"][path[1]].get("name")
        except (AttributeError, IndexError, KeyError, TypeError):
            name = None
        head = f"modules/{path[1]}" + (f" ({name})" if isinstance(name, str) else "")
        rest = "/".join(map(str, path[2:]))
        return head + (f": {rest}" if rest else "")
    return "/".join(map(str, path))


def check_manifest(path: Path, data) -> dict:
    """data when it is a valid manifest for the folder holding path; ManifestError otherwise."""
    path = Path(path)
    problems = validate(_schema(), data)
    if problems:
        p = problems[0]
        if p.path and p.path[-1] == "file" and p.validator == "pattern":
            rule = (f"{data['modules'][p.path[1]]['file']!r} is not a plain .so file name inside "
                    f"{path.parent} (no '/', no leading '.')")
        elif p.path == ["format"]:
            rule = (f"{p.message}: this manifest was written by another aot.py version; rebuild the "
                    f"folder with this one's aot.py")
        else:
            rule = f"{p.message} (schema rule '{p.validator}')"
        raise ManifestError(path, _field(data, p.path), rule)
    folder = path.parent.resolve()
    for i, entry in enumerate(data["modules"]):
        target = (path.parent / entry["file"]).resolve()  # a symlink may still point outside
        if folder not in target.parents:
            raise ManifestError(path, _field(data, ["modules", i, "file"]),
                                f"{entry['file']!r} resolves to {target}, outside the AOT folder "
                                f"{folder}")
    return data


def read_manifest(folder: Path) -> Optional[dict]:
    """The checked manifest of an AOT folder; None when it has none; ManifestError when bad."""
    path = Path(folder) / "manifest.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ManifestError(path, "(file)", f"cannot be read: {e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ManifestError(path, "(file)", f"is not valid JSON: {e}") from None
    return check_manifest(path, data)
