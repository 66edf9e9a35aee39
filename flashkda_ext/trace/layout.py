"""flashinfer-bench's dataset layout (flashinfer_bench.data.TraceSet: definitions_path,
workloads_path, blob_workloads_path), relative to the trace directory."""
from __future__ import annotations

import os
from typing import Any, Mapping


def definition_relpath(definition: Mapping[str, Any]) -> str:
    return os.path.join("definitions", definition["op_type"], f"{definition['name']}.json")


def workloads_relpath(definition: Mapping[str, Any]) -> str:
    return os.path.join("workloads", definition["op_type"], f"{definition['name']}.jsonl")


def blob_reldir(definition: Mapping[str, Any]) -> str:
    return os.path.join("blob", "workloads", definition["op_type"], definition["name"])

