"""Attention that scales: blocked (FlashAttention) attention, and block-sparse attention with
DeepSpeed's sparsity layouts.

The names below are imported on first use, so the sparsity layouts (`sparsity`, numpy only)
load without JAX: `jaxspeed.config` types `model.sparse_attention` with them.
"""

import importlib

#: public name -> the module that defines it
_PUBLIC = {
    "block_sparse_attention": "block_sparse", "dense_reference": "block_sparse",
    "blocked_attention": "blocked",
    **{name: "sparsity" for name in (
        "BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig",
        "FixedSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparsityConfig",
        "VariableSparsityConfig", "sparsity_config_from_dict")},
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC})
