"""Time-axis shifts the families' losses align their labels with (EAGLE's TTT steps, Medusa's heads, MTP's steps).

    shift_left(x, n)                     x moved n positions left along time, zero-filled at the end
    shift_targets(input_ids, valid, s)   (token s ahead of each position, whether it may be learnt)

Worked examples are in the docstrings; tests/test_alignment.py checks every family's labels against them.
"""

from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` moved left by n positions along dim 1 (time), the last n positions zero-filled.

    Worked example: tokens [A0 A1 A2 A3], n = 2 -> [A2 A3 0 0]. n = 0 returns x; n >= T gives all zeros.
    Negative shifts raise (nothing in the heads looks backwards).
    """
    if n < 0:
        raise ValueError(f"shift_left: shift {n} must be >= 0")
    if n == 0:
        return x
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def shift_targets(input_ids: torch.Tensor, valid: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token `shift` positions ahead of each position, and whether it may be learnt.

    Returns (ids [B,T] long, mask [B,T] bool): ids[t] = input_ids[t+shift] and mask[t] = valid[t+shift],
    padded at the end where t+shift runs past the sequence (id 0, mask 0). `valid` should already combine
    loss_mask and attention_mask: position t+shift must be a learnable, real token. Medusa head i uses
    shift 2+i; MTP step k embeds x[t+k] (shift k) and predicts x[t+1+k] (shift 1+k).
    Worked example, shift 2 with tokens [A0 A1 A2 A3] all valid: ids [A2 A3 pad pad], mask [1 1 0 0];
    shift 1: [A1 A2 A3 pad]. Raises ValueError for shift < 1 (a head never predicts its own or an
    earlier token).
    """
    if shift < 1:
        raise ValueError(f"shift must be >= 1 (token t+shift read at position t), got {shift}")
    return shift_left(input_ids, shift), shift_left(valid, shift).bool()
