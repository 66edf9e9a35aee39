"""vLLM adapters around a stand-in for vLLM's kernel (which cannot run on a CPU), for the bad-input tests:
the adapter a site installs, and a check that one call fell back with its reason counted."""
from __future__ import annotations

import inspect

from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.vllm import k3, vendored


def adapter(site):
    """The adapter of `site` ("k3.<name>" / "vendored.<name>") around a recorder with vLLM's signature."""
    point, _, name = site.partition(".")
    body = {"k3": k3.SERVE, "vendored": vendored.SERVE}[point][name]

    def original(**kw):
        return "original"
    original.__signature__ = inspect.signature(body)
    original.__name__ = name
    return fkda_vllm.adapter_for(site, original)


def fell_back(site, call, reason):
    """call() runs vLLM's original with one fallback counted whose reason contains `reason`."""
    before, reasons = fkda_vllm.STATS[site, "fell_back"], fkda_vllm.REASONS.copy()
    assert call() == "original"
    assert fkda_vllm.STATS[site, "fell_back"] == before + 1
    counted = [r for (s, r), n in fkda_vllm.REASONS.items() if s == site and n > reasons[s, r]]
    assert len(counted) == 1 and reason in counted[0], counted
