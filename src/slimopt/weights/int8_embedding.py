"""nn.Embedding with its table held on the device as int8 codes and fp32 scales (optim/algorithm/int8_weight.py).

A forward pass gathers the codes and scales of the rows its ids pick and dequantizes only those, so the table is
never held wider than 1 byte an element (LLaMA-7B: 125M elements, 250 MB in bf16). The backward pass adds each
position's gradient into its row of a table-sized gradient (nn.Embedding's backward op) and delivers it to the
master's sink (``Int8Weight``, int8_layer.py). One scale a row by default (``slimopt memory --int8-embeddings``
plans it so).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimopt.optim.algorithm import int8_weight
from slimopt.weights.int8_layer import Int8Weight

__all__ = ["Int8Embedding"]


class _Int8Gather(torch.autograd.Function):
    """out[..., :] = the dequantized table's row ids[...]. The table's gradient goes to the module (as
    _Int8Matmul's, int8_linear.py), the token getting a zero gradient in its place."""

    @staticmethod
    def forward(ctx, ids: Tensor, codes: Tensor, scale: Tensor, token: Tensor | None, module: Int8Embedding) -> Tensor:
        flat = ids.reshape(-1)
        ctx.save_for_backward(flat)
        ctx.module, ctx.rows = module, codes.shape[0]
        rows = int8_weight.dequantize(codes.index_select(0, flat), scale.index_select(0, flat), module.group,
                                      module.compute_dtype)  # code times scale, element by element: the table's bits
        return rows.view(*ids.shape, codes.shape[1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (flat,) = ctx.saved_tensors
        module: Int8Embedding = ctx.module
        grad_token = None
        if ctx.needs_input_grad[3]:
            # nn.Embedding's own backward (its sums in its order; the padding row takes no gradient)
            padding = -1 if module.padding_idx is None else module.padding_idx
            module.deliver(torch.ops.aten.embedding_dense_backward(grad_out.reshape(-1, grad_out.shape[-1]), flat,
                                                                   ctx.rows, padding, False))
            grad_token = torch.zeros((), dtype=torch.float32, device=grad_out.device)
        return None, None, None, grad_token, None


class Int8Embedding(Int8Weight):
    """An embedding table (num_embeddings, embedding_dim) held as int8 codes and scales, looked up in
    `compute_dtype` (the replaced table's dtype)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, group: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(num_embeddings, embedding_dim, group, device)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx must be within the {num_embeddings} rows, got {padding_idx}")
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.compute_dtype = dtype or torch.get_default_dtype()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: int = 0, master_dtype: torch.dtype = torch.float32,
                       master_device: torch.device | str = "cpu") -> Int8Embedding:
        """The int8 form of `embedding` on its device, with a master copy of its table
        (``Int8Weight.take_weight``). An embedding that renormalizes rows (max_norm), scales gradients by
        frequency or makes sparse gradients is refused: this one does none of those."""
        for what, on in (("max_norm", embedding.max_norm is not None), ("scale_grad_by_freq",
                         embedding.scale_grad_by_freq), ("sparse", embedding.sparse)):
            if on:
                raise ValueError(f"int8 embeddings: an nn.Embedding with {what} is not supported")
        w = embedding.weight
        table = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, group, w.device,
                    w.dtype)
        table.take_weight(w, master_dtype, master_device)
        return table

    def forward(self, ids: Tensor) -> Tensor:
        return _Int8Gather.apply(ids, self.weight_codes, self.weight_scale, self.grad_token(), self)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, group={self.group}")
