"""How DiLoCo's pseudo-gradients cross the wire: averaged over the ranks in a float dtype, or
quantized to 8 or 4 bits with a scale per chunk, with error feedback (engine/diloco.py steps
the outer optimizer with the result).

[Note: the quantized average]
With `comm_dtype` 'int8' or 'int4' each rank sends every parameter's pseudo-gradient x as
whole numbers q in [-L, L] (L = 127 or 7) and one scale per chunk of CHUNK consecutive
elements of that parameter (chunks start again at each parameter; the last one is padded with
zeros):

    s = max |x| over the chunk / L         (in the pseudo-gradient's dtype)
    q = round(x / s)                       (0 where s is 0)
    x' = q * s                             what the others receive

Integers cannot be summed on the wire without overflowing, so the ranks all-gather the payload
(q packed, two per byte for int4, then the scales' bytes: _pack) and every rank dequantizes every
rank's x' and sums them in rank order, then divides by the world size: every rank computes the
same sum in the same order, so all hold the same average, bit for bit. An all-gather moves
(N-1) payloads to each rank where a ring all-reduce of fp32 moves about 2 (N-1)/N of the fp32
tensor: at 4 bits (and a 4-byte scale per 128 elements) fewer bytes below about 15 ranks.

With error feedback (the default) what rounding left out stays on the rank and is added to the
next pseudo-gradient it sends: x = delta + e, then e = x - x'. Over many syncs the averages
then add up to the averages of the unrounded pseudo-gradients (as for PowerSGD's factors).
The same holds for the lossy float dtypes (bf16, fp16), whose x' is x rounded to that dtype.
A one-process simulation that follows these formulas in float64 equals a run exactly
(tests/test_diloco_streaming.py).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "Wire", "Exchange", "quantized_bytes"]

CHUNK = 128  # elements per scale of the quantized pseudo-gradient
LEVELS = {torch.int8: 127, torch.int4: 7}
# The pseudo-gradient crosses the wire in runs of at most this many bytes (wire dtype), so
# the copy it travels in is bounded whatever the model's size.
RUN_BYTES = 64 * 2**20


def padded(numel: int) -> int:
    return -(-numel // CHUNK) * CHUNK


def quantized_bytes(numels: list[int], dtype: torch.dtype, scale_bytes: int) -> int:
    """The payload of one rank for parameters of `numels` elements (see the Note)."""
    return payload_bytes(sum(padded(n) for n in numels), dtype, scale_bytes)


class Exchange:
    """One average in flight: `wait()` finishes it (once) and leaves the average in the
    tensors given to `Wire.start`."""

    def __init__(self, handles: list, finish):
        self.handles = handles
        self._finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for handle in self.handles:
            handle.wait()
        self._finish()
        self.done = True


class Wire:
    """Averages lists of tensors over `comm`'s ranks in `dtype` (None: their own), keeping each
    rank's error feedback by the key the caller gives each tensor."""

    def __init__(self, comm, dtype: torch.dtype | None, error_feedback: bool):
        self.comm = comm
        self.dtype = dtype
        self.error_feedback = error_feedback
        self.errors: dict[int, torch.Tensor] = {}  # key -> this rank's error feedback
        # Buffers kept from one send of a run to the next: a fresh one at each sync would cost
        # a page fault per 4 KiB on CPU, as long as the quantization itself. A quantized run's
        # `x` buffer holds its error feedback between sends (the errors are views of it).
        self._kept: dict[tuple, torch.Tensor] = {}
        self._sums: torch.Tensor | None = None  # the finishes' scratch, one at a time

    def _buffer(self, name: str, run, numel: int, dtype, device) -> torch.Tensor:
        """The kept buffer `name` of this run (the same tensors, so the same keys, each
        send), zeros when first made."""
        key = (name, tuple(k for k, _ in run))
        buf = self._kept.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = self._kept[key] = torch.zeros(numel, dtype=dtype, device=device)
        return buf

    def _scratch(self, numel: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers of `numel` for a finish's sum (or a send's whole numbers); the finishes
        run one after the other and copy their result out, and a send is done with them when
        it returns, so one pair serves every run."""
        if self._sums is None or self._sums.numel() < 2 * numel or self._sums.dtype != dtype \
                or self._sums.device != device:
            self._sums = torch.empty(2 * numel, dtype=dtype, device=device)
        return self._sums[:numel], self._sums[numel:2 * numel]

    def lossy(self, like: torch.dtype) -> bool:
        return self.dtype is not None and self.dtype != like

    @torch.no_grad()
    def start(self, keys: list[int], tensors: list[torch.Tensor], tag: str) -> Exchange:
        """Start averaging `tensors` in place (the caller waits on the Exchange before reading
        them); the error feedback is taken and updated now, at the send."""
        if self.comm.world == 1:
            return Exchange([], lambda: None)
        handles, finishes = [], []
        by_dtype: dict = {}
        for key, t in zip(keys, tensors):
            by_dtype.setdefault(t.dtype, []).append((key, t))
        for dtype, members in by_dtype.items():
            quantized = self.dtype in LEVELS
            wire = self.dtype or dtype
            size = 1 if quantized else torch.empty((), dtype=wire).element_size()
            run, nbytes = [], 0
            for member in members + [None]:
                if run and (member is None or nbytes + member[1].numel() * size > RUN_BYTES):
                    start = self._start_quantized if quantized else self._start_float
                    handle, finish = start(run, wire, tag)
                    handles.append(handle)
                    finishes.append(finish)
                    run, nbytes = [], 0
                if member is not None:
                    run.append(member)
                    nbytes += member[1].numel() * size
        return Exchange(handles, lambda: [f() for f in finishes])

    def _with_error(self, key: int, t: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """x = t + e (the tensor itself without error feedback); flat into `out` when given,
        which may be e itself (the last send's error, a view of the run's buffer): the sum
        goes element by element."""
        e = self.errors.get(key) if self.error_feedback else None
        if out is None:
            return t if e is None else t + e
        if e is None:
            return out.copy_(t.reshape(-1))
        return torch.add(t.reshape(-1), e.reshape(-1), out=out)

    def _keep_error(self, key: int, x: torch.Tensor, sent: torch.Tensor) -> None:
        if self.error_feedback:
            self.errors[key] = (x - sent).reshape(x.shape)

    # -- float dtypes: one all-reduce (mean) per run ---------------------------------------
    def _start_float(self, run, wire, tag):
        lossy = self.lossy(run[0][1].dtype)
        flat = self._buffer("flat", run, sum(t.numel() for _, t in run), wire, run[0][1].device)
        at = 0
        for key, t in run:
            x = self._with_error(key, t) if lossy else t
            piece = flat[at:at + t.numel()]
            piece.copy_(x.reshape(-1))
            if lossy:
                self._keep_error(key, x, piece.to(t.dtype).view_as(x))
            at += t.numel()
        handle = self.comm.all_reduce(flat, op="avg", async_op=True, tag=tag)

        def finish():
            offset = 0
            for _, t in run:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return handle, finish

    # -- int8 / int4: an all-gather of the payload, summed on every rank -------------------
    def _start_quantized(self, run, wire, tag):
        """Each step below is one pass over the run, in place where it can be: at 4.2M
        elements on one CPU thread the send and the sum take 9 ms where a chain of temporaries
        took 40 (see [Note: the quantized average] for what they compute)."""
        dtype, device = run[0][1].dtype, run[0][1].device
        level = LEVELS[wire]
        length = sum(padded(t.numel()) for _, t in run)
        xs = self._buffer("x", run, length, dtype, device)  # its padding stays zero
        at = 0
        for key, t in run:
            self._with_error(key, t, out=xs[at:at + t.numel()])
            at += padded(t.numel())
        chunks = xs.view(-1, CHUNK)
        # max |x| / L, as the larger of max x and -min x: two reductions that read x in place
        # (abs() would write a copy first; aminmax and vector_norm(inf) run 10-20x slower)
        scales = torch.maximum(chunks.amax(dim=1), chunks.amin(dim=1).neg_()).div_(level)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q, _ = self._scratch(length, dtype, device)  # free until the finishes
        q = torch.div(chunks, safe[:, None], out=q.view_as(chunks)).round_().clamp_(-level, level)
        payload = _pack(q, scales, wire, self._buffer("payload", run, payload_bytes(
            length, wire, scales.element_size()), torch.uint8, device))
        if self.error_feedback:  # q becomes x' = q * s, and xs the error x - x'
            chunks.sub_(q.mul_(scales[:, None]))
            at = 0
            for key, t in run:
                self.errors[key] = xs[at:at + t.numel()].view(t.shape)
                at += padded(t.numel())
        world = self.comm.world
        gathered = self._buffer("gathered", run, world * payload.numel(), torch.uint8, device)
        handle = self.comm.all_gather_into(gathered, payload, async_op=True, tag=tag)

        def finish():
            total, value = self._scratch(length, dtype, device)
            for r, part in enumerate(gathered.view(world, -1)):
                _unpack(part, length, dtype, wire, out=total if r == 0 else value)
                if r:
                    total.add_(value)
            total.div_(world)
            offset = 0
            for _, t in run:
                t.copy_(total[offset:offset + t.numel()].view_as(t))
                offset += padded(t.numel())
        return handle, finish


def payload_bytes(length: int, wire: torch.dtype, scale_bytes: int) -> int:
    """One rank's payload for `length` (padded) elements: the values, then a scale per
    chunk."""
    return (length if wire == torch.int8 else length // 2) + length // CHUNK * scale_bytes


def _pack(q: torch.Tensor, scales: torch.Tensor, wire: torch.dtype,
          payload: torch.Tensor) -> torch.Tensor:
    """[the values | the scales' bytes]: int8 one per byte; int4 biased by 8 to 0..15, two to
    a byte, the first half of the values in the low nibbles and the second half in the high
    ones (halves, not neighbours, so that packing and unpacking are contiguous passes)."""
    values = q.view(-1).to(torch.int8)
    count = values.numel() if wire == torch.int8 else values.numel() // 2
    if wire == torch.int8:
        payload[:count].copy_(values.view(torch.uint8))
    else:
        biased = values.add_(8).view(torch.uint8)
        torch.bitwise_left_shift(biased[count:], 4, out=payload[:count])
        payload[:count].bitwise_or_(biased[:count])
    payload[count:].copy_(scales.contiguous().view(torch.uint8))
    return payload


def _unpack(part: torch.Tensor, length: int, dtype, wire, out: torch.Tensor) -> None:
    """One rank's x' (q * s, see the Note) into `out` (`length` elements of `dtype`)."""
    count = length if wire == torch.int8 else length // 2
    values, scales = part[:count], part[count:].view(dtype)
    if wire == torch.int8:
        out.copy_(values.view(torch.int8))
    else:
        out[:count].copy_(values & 15)
        out[count:].copy_(values >> 4)
        out.sub_(8)
    out.view(-1, CHUNK).mul_(scales[:, None])
