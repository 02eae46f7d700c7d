"""Data: tokenizers, document sources, prepared (pre-tokenized) data, mixtures, packing and the resumable
grain pipeline (design: pipeline.py).

    data = TrainData(cfg.data, seed=cfg.train.seed, process_index=jax.process_index(),
                     process_count=jax.process_count())
    batch = next(data)        # {inputs, targets, segment_ids, positions, loss_mask}: [B_local, seq_len]
    state = data.get_state()  # JSON; a fresh TrainData(...).set_state(state) continues identically

The names below are imported on first use: `python -m lumen_jax.data.prepare` and its worker processes
need the tokenizers and sources, not grain (which starts JAX).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DataError": "errors", "BATCH_KEYS": "pipeline", "TrainData": "pipeline", "Documents": "sources",
    "builtin_documents": "sources", "file_documents": "sources", "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer", "Tokenizer": "tokenizer", "build_tokenizer": "tokenizer",
    "PreparedDocuments": "prepared",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lumen_jax.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lumen_jax.data.{_WHERE[name]}"), name)
