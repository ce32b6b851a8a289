"""DDP's gradient averaging with the input embedding's gradient sent as the rows the step's
tokens touch, not whole.

An embedding's gradient is zero in every row whose token no rank looked up this step. For the
~1B Llama (128,256 x 2,048) the dense gradient is 1 GB in fp32, while 2 ranks x 8,192 tokens touch
at most 16,384 rows (134 MB). The embedding's backward is also the last of the backward, so its
all-reduce has no later gradient computation to hide behind: every byte of it lengthens the step.
:class:`EmbeddingRowsAverage` all-reduces only the rows looked up by any rank (the token ids of
all ranks, gathered) and leaves the others at zero, which is what the dense average holds there.
The result equals DDP's dense average: the same sums of the same values per row.
"""

import torch
import torch.distributed as dist
from torch import nn


class EmbeddingRowsAverage:
    """The state of the DDP communication hook :func:`average_with_embedding_rows`
    (``ddp.register_comm_hook(state, average_with_embedding_rows)``), which averages every
    bucket over the ranks of ``group`` (None: the default group), with ``embedding``'s gradient
    averaged over the looked-up rows only.

    ``embedding`` must be the module's own, called on the token ids. Every forward with
    gradients enabled since the last synchronized backward is recorded (micro-batches under
    ``no_sync`` included); ``tokens_per_step`` is how many token ids each rank looks up in that
    span, the same on every rank: the hook gathers that many ids from every rank, and refuses
    any other count with an error instead of a mismatched collective. Where the rows of all
    ranks would be at least half the table, the embedding is averaged whole.

    ``reduce_dtype``: the dtype the gradients are sent in (the buckets keep their own; bf16
    halves the bytes and rounds each rank's gradient to 8 significant bits). Under NCCL the
    mean is taken inside the all-reduce (``ReduceOp.AVG``); other backends divide, then sum.
    """

    def __init__(
        self,
        embedding: nn.Embedding,
        tokens_per_step: int,
        reduce_dtype: torch.dtype = torch.float32,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be at least 1, got {tokens_per_step}")
        self.weight = embedding.weight
        self.tokens_per_step = tokens_per_step
        self.reduce_dtype = reduce_dtype
        self.group = group
        self._tokens: list[torch.Tensor] = []
        embedding.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if torch.is_grad_enabled():
            self._tokens.append(args[0].detach().reshape(-1))

    def average(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start ``bucket``'s average (one all-reduce); the future holds the averaged buffer."""
        buffer = bucket.buffer()
        table = next(
            (g for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
             if p is self.weight),
            None,
        )  # fmt: skip
        world = dist.get_world_size(self.group)
        ids = None if table is None else self._step_ids(world, table.shape[0])
        if ids is None:
            pieces = [buffer]
        else:
            start = (table.data_ptr() - buffer.data_ptr()) // buffer.element_size()
            end = start + table.numel()
            pieces = [buffer[:start], buffer[end:], table.index_select(0, ids).flatten()]
        if len(pieces) == 1 and buffer.dtype == self.reduce_dtype:
            sent = buffer  # averaged in place
        else:
            sent = torch.cat([p.to(self.reduce_dtype) for p in pieces])
        nccl = dist.get_backend(self.group) == "nccl"
        if not nccl:  # NCCL averages as it sums; others sum the ranks' shares
            sent.div_(world)
        op = dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM
        work = dist.all_reduce(sent, op=op, group=self.group, async_op=True)

        def written_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            mean = fut.value()[0]
            if mean is buffer:
                return buffer
            means = mean.split([p.numel() for p in pieces])
            whole = pieces if ids is None else pieces[:2]  # the rest: the looked-up rows
            for piece, m in zip(whole, means[: len(whole)], strict=True):
                piece.copy_(m)
            if ids is not None:
                rows = means[2].view(-1, table.shape[1])
                table.index_copy_(0, ids, rows.index_select(0, _first_occurrence(ids)))
            return buffer

        return work.get_future().then(written_back)

    def _step_ids(self, world: int, table_rows: int) -> torch.Tensor | None:
        """The token ids every rank looked up since the last synchronization, sorted; None
        where they would be at least half the table's rows (it is then sent whole)."""
        tokens, self._tokens = self._tokens, []
        local = torch.cat(tokens) if tokens else self.weight.new_empty(0, dtype=torch.long)
        if local.numel() != self.tokens_per_step:
            raise ValueError(
                f"the embedding looked up {local.numel()} tokens since the last gradient "
                f"synchronization, expected tokens_per_step={self.tokens_per_step} (per rank, "
                "the same on every rank)"
            )
        if 2 * world * local.numel() >= table_rows:
            return None
        gathered = local.new_empty(world * local.numel())
        _all_gather(gathered, local, group=self.group)
        return torch.sort(gathered).values


def average_with_embedding_rows(
    state: EmbeddingRowsAverage, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``bucket`` averaged over the ranks, the embedding of ``state``
    over the rows looked up since the last synchronization."""
    return state.average(bucket)


def _all_gather(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's ``local`` (equal sizes) into ``output``, concatenated in rank order. torch
    >= 2.14 names this collective ``all_gather_single`` (the older name warns)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def _first_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """For each position of the sorted ``ids``, the position of the first equal id: every copy
    of a repeated row then takes the same values, so writing them is the same whichever copy
    lands last."""
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    where = torch.arange(ids.numel(), device=ids.device)
    return torch.cummax(torch.where(first, where, 0), 0).values
