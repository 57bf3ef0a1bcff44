"""The built-in models' training losses (mean reduction), one per task of `hetpipe.models`.

Module-level functions, so worker processes import them by name (``hetpipe.models:lm_loss``
keeps working: `hetpipe.models` re-exports them).

Example:
    >>> import torch
    >>> regression_loss(torch.zeros(2), torch.zeros(2)).item()
    0.0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens: logits ``(..., vocab)``, targets ``(...)``.

    Example:
        >>> round(lm_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)).item(), 4)  # ln 4
        1.3863
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: logits ``(batch, classes)``, targets ``(batch,)``.

    Example:
        >>> round(classification_loss(torch.zeros(2, 2), torch.tensor([0, 1])).item(), 4)  # ln 2
        0.6931
    """
    return F.cross_entropy(logits, targets)


def regression_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error.

    Example:
        >>> regression_loss(torch.ones(2, 2), torch.zeros(2, 2)).item()
        1.0
    """
    return F.mse_loss(output, targets)
