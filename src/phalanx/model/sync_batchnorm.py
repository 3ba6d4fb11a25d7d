"""Synchronized BatchNorm: batch statistics over every rank of a process group, on CPU and GPU.

In training mode BatchNorm normalises with the statistics of the batch it sees. Under data
parallelism a rank sees 1/N of the global batch, so N ranks would train a different model from
one process on the whole batch. `SyncBatchNorm` computes the statistics of the global batch
instead, so the two agree within round-off: outputs, input gradients, averaged weight and bias
gradients, and the running statistics. `torch.nn.SyncBatchNorm` does the same with CUDA kernels
only; this one uses plain tensor operations and collectives through a `Comm`
(`phalanx.comm.collectives`), so it runs with gloo on CPU as well as NCCL on GPU.

    model = convert_sync_batchnorm(model)     # what px.prepare(..., sync_batchnorm=True) does

Eval mode, a world of one and a missing process group all fall back to ordinary BatchNorm.

[Note: one collective each way]
Forward: each rank computes, per channel, its count, mean and biased variance (stably, see
`_local_moments`), packs them as [mean (C), var (C), count] and all-gathers that one small
tensor. Every rank then combines the N triples with the pairwise formula of Chan, Golub and
LeVeque ("Updating formulae and a pairwise algorithm for computing sample variances", 1979):

    mean = sum_r n_r m_r / n,   M2 = sum_r n_r v_r + sum_r n_r (m_r - mean)^2,   var = M2 / n

Counts weight the ranks, so uneven batches (the last one of an epoch, even an empty one) are
exact. Every rank combines the same gathered numbers in the same order, so all ranks hold
bit-identical statistics. An all-reduce of [sum, sum of squares, count] would also be a single
collective, but E[x^2] - E[x]^2 cancels catastrophically when |mean| >> std: with mean 1000 and
std 1 in fp32 its variance came out 10-30% off (tests/test_sync_batchnorm.py shows the combined
form stays within 1e-4). The gathered tensor is N * (2C + 1) numbers, a few KB: both
collectives are bound by latency, not size.

Backward: with xhat = (x - mean) * invstd and means over the GLOBAL batch,

    dx = weight * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))

so the per-channel sums of dy and dy * xhat are all-reduced, packed into one tensor. The weight
and bias gradients are the LOCAL sums of dy * xhat and dy: data parallelism averages gradients
over ranks, and the mean of the local sums is exactly the single-process gradient of the mean
of the ranks' losses. Each rank's dx is the gradient of the ranks' losses summed, as it is for
any layer under data parallelism, and that is what makes the averaged gradients of the layers
below come out right. When the input needs no gradient (BatchNorm straight on the data) the
backward has nothing to communicate and skips the all-reduce.

Both go through a `Comm` that the layer holds for its process group (`SyncBatchNorm.comm`, made
at the first synchronized forward, and again if the group changes), tagged
"sync_batchnorm:stats" and "sync_batchnorm:grads"; its record holds the layer's traffic. The
Comm picks the all-gather's primitive: on gloo one broadcast per rank, which for 129 floats on
2 ranks took 1.0-1.3 ms here against 1.1-1.6 ms for gloo's all-gather.

Why an explicit `autograd.Function` rather than autograd through a differentiable collective:
the forward combines the ranks' moments with Chan's formula, which is not a sum, so autograd
would need a differentiable all-gather (backward: a reduce-scatter), and it saves every
intermediate for backward. Even the cheapest autograd form, `torch.distributed.nn.functional`
all-reduce of [sum, sum of squares, count] (unstable, see above, and deprecated in torch 2.13 for
a private module), measured slower: on 2 gloo ranks, input (32, 64, 32, 32) fp32, forward plus
backward took 26-32 ms here against 56-62 ms through autograd (18 ms for unsynchronized
BatchNorm), and autograd kept 16 MB of activations per layer where this keeps only the input.
The explicit backward is also short enough to check against the formula above.

Arithmetic is in fp32 (fp64 for fp64 inputs), also for fp16/bf16 inputs; the output has the
input's dtype. The normalisation is `x * (weight * invstd) + (bias - mean * weight * invstd)`, the
form PyTorch's own CPU kernel uses, in one pass over the activations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm.collectives import Comm
from ..world import runtime

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reduced_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels (dim 1)."""
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """View a (C,) vector so that it broadcasts over (N, C, ...) `x`."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _local_moments(xc: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of this rank's batch, computed stably.

    On CUDA `torch.var_mean` is one fused Welford pass over the activations. On CPU it runs a
    scalar Welford loop that measured 7x slower than this corrected two-pass algorithm (Chan,
    Golub and LeVeque, "Algorithms for computing the sample variance", 1983: the sum of squared
    deviations from the mean, less the square of their sum, which cancels the mean's own
    round-off), so the CPU uses the two-pass form.
    """
    dims = _reduced_dims(xc)
    if xc.is_cuda:
        var, mean = torch.var_mean(xc, dim=dims, correction=0)
        return mean, var
    mean = xc.sum(dims) / count
    dev = xc - _per_channel(mean, xc)
    var = ((dev * dev).sum(dims) - dev.sum(dims) ** 2 / count) / count
    return mean, var


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over the global batch. See [Note: one collective each way].

    Returns (output, mean, unbiased var); the last two are for the running statistics and
    carry no gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, comm: Comm):
        cdt = _compute_dtype(x)
        channels = x.shape[1]
        local_count = x.numel() // channels
        xc = x.to(cdt)
        if local_count > 0:
            mean, var = _local_moments(xc, local_count)
        else:  # an empty batch on this rank still takes part, with weight zero
            var = mean = torch.zeros(channels, dtype=cdt, device=x.device)
        count = torch.full((1,), local_count, dtype=cdt, device=x.device)
        packed = torch.cat([mean, var, count])
        gathered = packed.new_empty(comm.world * packed.numel())  # flat: one chunk per rank
        comm.all_gather_into(gathered, packed, tag="sync_batchnorm:stats")
        means, variances, counts = gathered.view(comm.world, -1).split([channels, channels, 1],
                                                                       dim=1)

        total = counts.sum()
        # A device-to-host read costs a GPU sync, so the global count is only read when this
        # rank alone cannot prove that there is more than one value per channel. Every rank
        # gathered the same counts, so every rank raises together.
        if local_count <= 1 and total.item() <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got a global batch of "
                f"{int(total.item())} value per channel (local input size {tuple(x.shape)}); "
                "use a larger batch or call model.eval()")
        mean = (counts * means).sum(0) / total
        m2 = (counts * variances).sum(0) + (counts * (means - mean) ** 2).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)

        scale = invstd if weight is None else invstd * weight.to(cdt)
        shift = -mean * scale if bias is None else bias.to(cdt) - mean * scale
        y = torch.addcmul(_per_channel(shift, x), xc, _per_channel(scale, x)).to(x.dtype)

        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.comm = comm
        unbiased_var = m2 / (total - 1)
        ctx.mark_non_differentiable(mean, unbiased_var)
        return y, mean, unbiased_var

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_var):
        x, weight, mean, invstd, total = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        cdt = _compute_dtype(x)
        dims = _reduced_dims(x)
        dy = grad_y.to(cdt)
        xhat = (x.to(cdt) - _per_channel(mean, x)) * _per_channel(invstd, x)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)

        grad_x = grad_w = grad_b = None
        if need_w:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if need_b:
            grad_b = sum_dy.to(weight.dtype if weight is not None else x.dtype)
        if need_x:
            packed = torch.cat([sum_dy, sum_dy_xhat])
            ctx.comm.all_reduce(packed, op="sum", tag="sync_batchnorm:grads")
            mean_dy, mean_dy_xhat = (packed / total).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(cdt)
            # dx = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), in two passes.
            grad_x = torch.addcmul(_per_channel(-scale * mean_dy, x), dy, _per_channel(scale, x))
            grad_x = grad_x.addcmul_(xhat, _per_channel(-scale * mean_dy_xhat, x)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W) inputs whose training
    statistics are those of the whole batch of every rank in `process_group`.

    `process_group=None` means the job's default group, looked up at each forward (so the module
    deep-copies and pickles). In eval mode, or with no group or a group of one, it is exactly
    `torch.nn.BatchNorm*d`. Parameters, buffers and state_dict keys are those of BatchNorm, so
    checkpoints move freely between converted and unconverted models.

    Every rank of the group must call forward (and backward) for every synchronized layer, as
    with any collective: a rank with no samples passes an empty batch rather than skipping.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group
        self._comm: Comm | None = None

    @property
    def comm(self) -> Comm | None:
        """The `Comm` this layer's collectives go through (None before its first synchronized
        forward). Its record holds this layer's traffic."""
        return self.__dict__.get("_comm")

    def _comm_for(self, group) -> Comm:
        comm = self.comm
        if comm is None or comm.group is not group:
            comm = self._comm = Comm(group)
        return comm

    def __getstate__(self):
        # A Comm holds a process group, which neither deep-copies nor pickles: a copy makes its own.
        return {**super().__getstate__(), "_comm": None}

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"SyncBatchNorm expects a 2D to 5D input (N, C, ...), got a "
                             f"{input.dim()}D input of shape {tuple(input.shape)}")

    def _group(self):
        group = self.process_group if self.process_group is not None else runtime.default_group()
        if group is None:
            return None
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this rank is not a member of the SyncBatchNorm's process group; "
                             "pass a group that contains every rank running the model")
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self._group() if self.training else None
        if group is None:
            return super().forward(input)  # ordinary BatchNorm: eval mode or a world of one
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm expects {self.num_features} channels (dim 1), "
                             f"got input of shape {tuple(input.shape)}")

        y, mean, var = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps,
                                                    self._comm_for(group))

        if self.track_running_stats and self.running_mean is not None:
            # The same bookkeeping as _BatchNorm.forward, with the global statistics.
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype),
                                                       alpha=factor)
        return y


def _is_synchronized(module: nn.Module) -> bool:
    return isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm))


def _convert_one(bn: _BatchNorm, group) -> SyncBatchNorm:
    """A SyncBatchNorm that holds `bn`'s very parameter and buffer objects, under the same names."""
    if any(nn.parameter.is_lazy(t) for t in [*bn.parameters(False), *bn.buffers(False)]):
        raise ValueError(f"cannot convert the lazy {type(bn).__name__} before it has seen an "
                         "input; run one forward pass first so its shapes are known")
    # Built on the meta device: its own tensors are replaced at once, so nothing is allocated.
    sync = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine,
                         bn.track_running_stats, process_group=group, device="meta")
    sync._parameters.clear()
    sync._parameters.update(bn._parameters)
    sync._buffers.clear()
    sync._buffers.update(bn._buffers)
    sync._non_persistent_buffers_set = set(bn._non_persistent_buffers_set)
    sync.train(bn.training)
    return sync


def convert_sync_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace every BatchNorm in `module` (or `module` itself) with a `SyncBatchNorm`.

    Every subclass of `_BatchNorm` is converted except those already synchronized (this class
    and `torch.nn.SyncBatchNorm`), so converting twice changes nothing. The converted layers keep
    the original parameter and buffer objects, names and training flag; a BatchNorm shared by two
    parents stays shared. `group=None` means the job's default group at each forward. Returns
    `module` with its children replaced in place, or the new layer when `module` is a BatchNorm.
    """
    converted: dict[int, nn.Module] = {}

    def convert(m: nn.Module) -> nn.Module:
        if id(m) in converted:
            return converted[id(m)]
        if isinstance(m, _BatchNorm) and not _is_synchronized(m):
            new = _convert_one(m, group)
        else:
            new = m
            for name, child in list(m._modules.items()):  # named_children() skips repeats
                replacement = convert(child)
                if replacement is not child:
                    m.add_module(name, replacement)
        converted[id(m)] = new
        return new

    return convert(module)
