"""World-size-invariant dense gradients: the order of the batch sum is part of the model.

A dense (data-parallel) parameter's gradient is a sum over the samples of the global batch. One
process sums the whole batch inside one GEMM; N ranks each sum their slice and DDP adds the N
partial sums. Both are right to float precision, but they differ in the last bits, and the
default training is chaotic: a one-ulp change of a single dense weight at step 0 moves the final
eval AUC in the 4th decimal (ReLU units that flip on one sample and Adagrad's ``1 / sqrt(sum g^2)``
turn it into steps of full size, and the difference spreads). So "N ranks train the same model
as one process" only holds to 4 decimals if the arithmetic is the same, bit for bit.

``train.dense_blocks = G`` makes it so. The global batch is cut into G equal contiguous blocks;
the dense part runs on each block on its own (same shapes on any world size), and the gradients
of the blocks are added in a fixed pairwise tree (``tree_sum``: first half of the blocks, second
half, recursively, then the two halves). With N ranks, N a power of two dividing G, rank r holds
blocks ``[r G/N, (r+1) G/N)``, a whole subtree: it sums them in the same tree, and the ranks'
sums are added in the top of the tree (2 ranks: one commutative addition, DDP's own all-reduce;
4 or more: ``coded_all_reduce`` sums rank parts in the same tree). One process and every such
world size then compute bitwise the same gradients, weights and metrics. The embedding side is
already exact for table-wise shards (whole bags, duplicates summed in a fixed order); row-wise
partial sums and data-parallel tables agree to float tolerance.

The trainer also computes the loss and the eval probabilities per block (``per_block``): an
elementwise kernel may round its vectorized body and its scalar tail differently (sigmoid does),
so the same sample must sit in a tensor of the same size on every world size.

Other world sizes run each rank's slice as one block (equal to float tolerance, as before).
Blocking changes no value beyond float rounding: each sample's output is its own, and a block's
gradient is its samples' share of the batch gradient. G = 1 is the plain one-GEMM gradient.

What makes a block's arithmetic the same in one process and on a rank is that its calls are the
same: the same shapes, strides and memory alignment, and the same number of threads. The blocks
give the shapes. Each block runs on inputs copied into new memory and passes its output gradient
on in new memory (``_Fresh``), so a block that starts at an odd offset of the batch is aligned
like a rank's own tensors (a BLAS may take another path for unaligned data). The thread count is
the caller's: MKL / oneDNN choose their kernels per CPU, shape and thread count, so the bitwise
equality holds when every process runs the same number of threads (``train.threads``), and
otherwise to float tolerance (docs/distributed.md, "What is bitwise, and where").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from neorec.distributed.comm import tree_sum

__all__ = ["exact_world", "local_blocks", "block_dense", "blocks_of", "per_block"]


def exact_world(blocks: int, world: int) -> bool:
    """Whether ``world`` ranks reproduce one process bitwise with ``blocks`` dense blocks."""
    return world >= 1 and world & (world - 1) == 0 and blocks % world == 0


def local_blocks(blocks: int, world: int) -> int:
    """Blocks of each rank's slice: ``blocks / world`` when exact, else 1 (the slice as is)."""
    return blocks // world if exact_world(blocks, world) else 1


class _TreeFanout(torch.autograd.Function):
    """``n`` aliases of each parameter; backward adds their gradients in the ``tree_sum`` order."""

    @staticmethod
    def forward(ctx: Any, n: int, *params: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.n, ctx.k = n, len(params)
        return tuple(p.view_as(p) for _ in range(n) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        n, k = ctx.n, ctx.k
        return (None, *(tree_sum([grads[i * k + j] for i in range(n)]) for j in range(k)))


class _Fresh(torch.autograd.Function):
    """A copy of ``x`` in new (allocator-aligned) memory; its gradient is passed on in new
    memory too."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.clone(memory_format=torch.contiguous_format)


class _BlockedForward:
    """``module.forward`` run block by block (installed on the instance by ``block_dense``)."""

    def __init__(self, module: nn.Module, blocks: int) -> None:
        self.module, self.blocks = module, blocks
        self.plain = type(module).forward
        self._inside = False

    def __call__(self, *inputs: Tensor) -> Tensor:
        m, n = self.module, self.blocks
        rows = inputs[0].shape[0]
        if self._inside or rows % n:
            return self.plain(m, *inputs)
        chunks = [tuple(_Fresh.apply(x) for x in c) for c in zip(*(x.chunk(n) for x in inputs))]
        if n <= 2 or not torch.is_grad_enabled():
            # Two blocks: autograd adds their gradients in one commutative addition, the tree
            # (a module that used a parameter twice per forward would need the aliases below).
            outs = [self.plain(m, *c) for c in chunks]
        else:
            outs = self._tree_blocks(chunks)
        outs = [_Fresh.apply(o) for o in outs]
        return outs[0] if n == 1 else torch.cat(outs)

    def _tree_blocks(self, chunks: list[tuple[Tensor, ...]]) -> list[Tensor]:
        """The blocks' outputs, each computed with its own aliases of the parameters, whose
        gradients ``_TreeFanout`` adds in the tree order."""
        m, n = self.module, len(chunks)
        named = [(k, p) for k, p in m.named_parameters() if p.requires_grad]
        aliases = _TreeFanout.apply(n, *(p for _, p in named))
        k = len(named)
        outs = []
        self._inside = True  # functional_call calls the module, i.e. this object, again
        try:
            for i, c in enumerate(chunks):
                params = {name: aliases[i * k + j] for j, (name, _) in enumerate(named)}
                outs.append(functional_call(m, params, c))
        finally:
            self._inside = False
        return outs


def block_dense(module: nn.Module, blocks: int) -> nn.Module:
    """Run ``module`` (inputs and output batch-major) in ``blocks`` blocks with tree-summed
    gradients, each block in memory of its own; parameters, state_dict and outputs are
    unchanged. ``blocks = 1`` (a rank holding one block) runs the batch as one such block.
    Returns ``module``."""
    if blocks < 1:
        raise ValueError(f"dense blocks must be >= 1, got {blocks}")
    module.forward = _BlockedForward(module, blocks)  # type: ignore[method-assign]
    return module


def blocks_of(model: object) -> int:
    """Blocks per batch of ``model.dense_arch`` (under DDP or not); 1 if it is not blocked."""
    dense = getattr(model, "dense_arch", None)
    dense = getattr(dense, "module", dense)  # DistributedDataParallel wraps the real module
    forward = getattr(dense, "forward", None)
    return forward.blocks if isinstance(forward, _BlockedForward) else 1


def per_block(fn: Callable[..., Tensor], blocks: int, *inputs: Tensor) -> list[Tensor]:
    """``fn`` on each of ``blocks`` equal row blocks of ``inputs`` (all of them at once if the rows
    do not split evenly)."""
    if blocks > 1 and inputs[0].shape[0] % blocks == 0:
        return [fn(*c) for c in zip(*(x.chunk(blocks) for x in inputs))]
    return [fn(*inputs)]
