"""Adapters that let serving stacks call flashkda_ext in their own call shapes (docs/integrations.md).

fla: a backend for fla's registry (flashkda_ext.integrations.fla.register()).
sglang: a kernel backend with SGLang's linear-attention call shapes (no sglang import).
"""
