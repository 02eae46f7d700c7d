"""Data: tokenizers, document sources, packing and the resumable grain pipeline (design: pipeline.py).

    data = TrainData(cfg.data, seed=cfg.train.seed, process_index=jax.process_index(),
                     process_count=jax.process_count())
    batch = next(data)        # {inputs, targets, segment_ids, positions, loss_mask}: [B_local, seq_len]
    state = data.get_state()  # JSON; a fresh TrainData(...).set_state(state) continues identically
"""

from lumen_jax.data.errors import DataError
from lumen_jax.data.pipeline import BATCH_KEYS, TrainData
from lumen_jax.data.sources import Documents, builtin_documents, file_documents
from lumen_jax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = ["BATCH_KEYS", "ByteTokenizer", "DataError", "Documents", "HFTokenizer", "TrainData", "Tokenizer",
           "build_tokenizer", "builtin_documents", "file_documents"]
