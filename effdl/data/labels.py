"""Next-token labels, made where the batch is made (in the DataLoader workers).

``labels[:, t] = input_ids[:, t + 1]`` while that next token is real, else ``IGNORE_INDEX``
(``F.cross_entropy``'s default ``ignore_index``), the one value every effdl pipeline uses for
"no target here".
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def shifted_labels(ids: np.ndarray, real: np.ndarray) -> np.ndarray:
    """Labels (B, T) int64 of right-padded ``ids`` (B, T); ``real`` (B, T) bool marks tokens.

    The last column and every position whose next token is padding get ``IGNORE_INDEX``.
    """
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    np.copyto(labels[:, :-1], ids[:, 1:], where=real[:, 1:])
    return labels
