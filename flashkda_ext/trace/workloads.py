"""Workloads: one workload line of a call (var axes, scalars, data tensors as random) and its index
tensors, saved by content with safetensors under the definition's blob folder."""
from __future__ import annotations

import os
import uuid as _uuid
from typing import Any, Dict, List, Mapping, Optional

from .expr import safe_eval
from .layout import blob_reldir
from .templates import load_template


def _index_tensors_on_host(inputs: Mapping[str, Any], names) -> Optional[Dict[str, Any]]:
    """The index tensors as CPU tensors, or None when they cannot be read: meta tensors (no data),
    or CUDA ones while a graph is being captured (a copy to the host would break the capture)."""
    tensors = {n: inputs[n] for n in names}
    if any(x.device.type == "meta" for x in tensors.values()):
        return None
    if any(x.device.type == "cuda" for x in tensors.values()):
        import torch
        if torch.cuda.is_current_stream_capturing():
            return None
    return {n: x.detach().to("cpu").contiguous() for n, x in tensors.items()}


def makedirs(path: str, created: Optional[List[str]] = None) -> None:
    """os.makedirs(path, exist_ok=True); with `created`, the folders it made are appended to it,
    outermost first (what emission.retract removes again, if still empty)."""
    if created is None:
        os.makedirs(path, exist_ok=True)
        return
    missing = []
    d = os.path.abspath(path)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    os.makedirs(path, exist_ok=True)
    created.extend(reversed(missing))


def save_index_tensors(trace_dir: str, definition: Mapping[str, Any], tensors: Mapping[str, Any],
                       created: Optional[List[str]] = None) -> str:
    """Write `tensors` with safetensors under the definition's blob folder; returns the path
    relative to trace_dir. Named by content: a decode loop that reuses its indices writes one file.
    With `created`, the folders and the file this call made (none when the file was there) are
    appended to it, in the order made."""
    import hashlib
    try:
        import safetensors.torch
    except ImportError as e:
        raise RuntimeError("tracing stores index tensors with the safetensors package: "
                           "pip install safetensors") from e
    data = safetensors.torch.save(dict(tensors))
    name = definition["name"]
    rel = os.path.join(blob_reldir(definition), f"{name}_{hashlib.sha1(data).hexdigest()[:20]}.safetensors")
    path = os.path.join(trace_dir, rel)
    if not os.path.exists(path):
        makedirs(os.path.dirname(path), created)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        if created is not None:
            created.append(path)
    return rel


def index_inputs(op: str, definition: Mapping[str, Any]) -> list:
    """The definition's index inputs (stored in every workload, never drawn at random)."""
    # dict.fromkeys: a name the template lists once per layout (kda_verify's state_indices) counts once
    return list(dict.fromkeys(e["name"] for e in load_template(op)["inputs"]
                              if e.get("index") and e["name"] in definition["inputs"]))


def build_workload(op: str, f: Mapping[str, Any], definition: dict, inputs: Mapping[str, Any],
                   trace_dir: Optional[str] = None, created: Optional[List[str]] = None) -> Optional[dict]:
    """One workload line. With trace_dir, the index tensors are saved there and referenced; None
    when they cannot be read (CUDA graph capture). Without, they are left `random` (a workload only
    for its axes, e.g. a constraint check). `created`: as save_index_tensors'."""
    t = load_template(op)
    uid = str(_uuid.uuid4())
    axes = {a: int(safe_eval(t["axes"][a]["bind"], f))
            for a, ax in definition["axes"].items() if ax["type"] == "var"}
    sources = {}
    for e in t["inputs"]:
        name = e["name"]
        if name not in definition["inputs"]:
            continue
        if e["shape"] is None:
            value = safe_eval(e["scalar"], f)
            sources[name] = {"type": "scalar", "value": int(value) if e["dtype"].startswith("int") else float(value)}
        else:
            sources[name] = {"type": "random"}
    index = index_inputs(op, definition)
    if trace_dir is not None and index:
        host = _index_tensors_on_host(inputs, index)
        if host is None:
            return None
        rel = save_index_tensors(trace_dir, definition, host, created)
        for name in index:
            sources[name] = {"type": "safetensors", "path": rel, "tensor_key": name}
    return {"definition": definition["name"],
            "workload": {"uuid": uid, "axes": axes, "inputs": sources},
            "solution": None, "evaluation": None}
