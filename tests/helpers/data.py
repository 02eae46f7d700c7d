"""Synthetic packed batches for model and step tests (no data pipeline involved)."""

import numpy as np


def packed_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random tokens packed as 1-3 documents per row, with positions, segment ids and a pad tail."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq - 2), size=rng.integers(0, 3), replace=False))
        bounds = [0, *cuts.tolist(), seq - rng.integers(0, 3)]  # a short padding tail
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[b, lo:hi] = i + 1
            pos[b, lo:hi] = np.arange(hi - lo)
    same_doc_next = np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros((batch, 1), bool)], axis=1)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg, "positions": pos,
            "loss_mask": ((seg > 0) & same_doc_next).astype(np.float32)}
