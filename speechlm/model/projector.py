"""Frame-stacking projector: encoder frames -> LLM embeddings at a lower frame rate.

Letters: B batch, U encoder frames, E encoder width, V = ceil(U / stack) projected frames, H LLM hidden.

``stack`` consecutive frames are concatenated (``[B, V, stack * E]``; the tail is zero-padded) and
passed through ``Linear -> GELU -> (dropout) -> Linear``. Frames past each clip's length are zeroed
before stacking, so a clip's last stacked frame does not depend on the batch's padding.

Packed input (``[sum U_b, E]``, 2-D, the padding-free encoder's output): each clip's frames are
copied into a buffer of ``ceil(U_b / stack) * stack`` rows (the clip's own tail zero-padded), so
the MLP runs on ``sum ceil(U_b / stack)`` stacked frames and returns them packed, ``[sum V_b, H]``;
no padding row of the batch reaches it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def compute_stacked_lengths(lens_B: Tensor, stack: int) -> Tensor:
    return torch.div(lens_B.to(torch.long) + stack - 1, stack, rounding_mode="floor")


class FrameStackProjector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stack: int, hidden: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        if stack < 1:
            raise ValueError(f"projector stack must be >= 1, got {stack}")
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.stack = stack
        self.fc1 = nn.Linear(in_dim * stack, hidden)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x_BUE: Tensor, lens_B: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, U, E]`` padded -> ``([B, V, H], V_b)``; ``[sum U_b, E]`` packed -> ``([sum V_b, H], V_b)``."""
        if x_BUE.dim() == 2:
            return self._forward_packed(x_BUE, lens_B)
        B, U, E = x_BUE.shape
        if E != self.in_dim:
            raise ValueError(
                f"projector expects width {self.in_dim}, got input of shape {tuple(x_BUE.shape)}"
            )
        lens_B = lens_B.to(device=x_BUE.device, dtype=torch.long)
        valid_BU1 = (torch.arange(U, device=x_BUE.device)[None, :] < lens_B[:, None]).unsqueeze(-1)
        x_BUE = x_BUE.masked_fill(~valid_BU1, 0.0)
        pad = -U % self.stack
        if pad:
            x_BUE = nn.functional.pad(x_BUE, (0, 0, 0, pad))
        x_BVS = x_BUE.reshape(B, (U + pad) // self.stack, self.stack * E)
        out_BVH = self.fc2(self.dropout(self.act(self.fc1(x_BVS))))
        return out_BVH, compute_stacked_lengths(lens_B, self.stack)

    def _forward_packed(self, x_UE: Tensor, lens_B: Tensor) -> tuple[Tensor, Tensor]:
        lens_B = lens_B.to(device=x_UE.device, dtype=torch.long)
        if x_UE.shape[1] != self.in_dim or x_UE.shape[0] != int(lens_B.sum()):
            raise ValueError(
                f"packed projector input must be [sum of lens = {int(lens_B.sum())}, {self.in_dim}], "
                f"got {tuple(x_UE.shape)}"
            )
        out_lens_B = compute_stacked_lengths(lens_B, self.stack)
        slots_B = out_lens_B * self.stack
        dest_starts_B = torch.cumsum(slots_B, 0) - slots_B
        src_starts_B = torch.cumsum(lens_B, 0) - lens_B
        clip_U = torch.repeat_interleave(torch.arange(lens_B.numel(), device=x_UE.device), lens_B)
        dest_U = (
            dest_starts_B[clip_U] + torch.arange(x_UE.shape[0], device=x_UE.device) - src_starts_B[clip_U]
        )
        buf = x_UE.new_zeros(int(slots_B.sum()), self.in_dim).index_copy(0, dest_U, x_UE)
        x_VS = buf.reshape(-1, self.stack * self.in_dim)
        return self.fc2(self.dropout(self.act(self.fc1(x_VS)))), out_lens_B
