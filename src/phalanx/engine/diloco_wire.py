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
(q packed, two per byte for int4, then the scales' bytes) and every rank dequantizes every
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
    length = sum(padded(n) for n in numels)
    values = length if dtype == torch.int8 else length // 2
    return values + length // CHUNK * scale_bytes


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

    def _with_error(self, key: int, t: torch.Tensor) -> torch.Tensor:
        """x = t + e (the tensor itself without error feedback)."""
        if not self.error_feedback:
            return t
        e = self.errors.get(key)
        return t if e is None else t + e

    def _keep_error(self, key: int, x: torch.Tensor, sent: torch.Tensor) -> None:
        if self.error_feedback:
            self.errors[key] = (x - sent).reshape(x.shape)

    # -- float dtypes: one all-reduce (mean) per run ---------------------------------------
    def _start_float(self, run, wire, tag):
        lossy = self.lossy(run[0][1].dtype)
        flat = torch.empty(sum(t.numel() for _, t in run), dtype=wire, device=run[0][1].device)
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
        dtype, device = run[0][1].dtype, run[0][1].device
        level = LEVELS[wire]
        length = sum(padded(t.numel()) for _, t in run)
        xs = torch.zeros(length, dtype=dtype, device=device)
        at = 0
        for key, t in run:
            xs[at:at + t.numel()].copy_(self._with_error(key, t).reshape(-1))
            at += padded(t.numel())
        chunks = xs.view(-1, CHUNK)
        scales = chunks.abs().amax(dim=1) / level
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(chunks / safe[:, None]).clamp_(-level, level)
        if self.error_feedback:
            sent = (q * scales[:, None]).view(-1)
            at = 0
            for key, t in run:
                self._keep_error(key, xs[at:at + t.numel()].view_as(t),
                                 sent[at:at + t.numel()].view_as(t))
                at += padded(t.numel())
        payload = _pack(q.to(torch.int8).view(-1), scales, wire)
        world = self.comm.world
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=device)
        handle = self.comm.all_gather_into(gathered, payload, async_op=True, tag=tag)

        def finish():
            total = None
            for part in gathered.view(world, -1):
                q_r, s_r = _unpack(part, length, dtype, wire)
                value = (q_r.to(dtype).view(-1, CHUNK) * s_r[:, None]).view(-1)
                total = value if total is None else total.add_(value)
            total.div_(world)
            offset = 0
            for _, t in run:
                t.copy_(total[offset:offset + t.numel()].view_as(t))
                offset += padded(t.numel())
        return handle, finish


def _pack(q: torch.Tensor, scales: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """[the values (int8 as bytes, or int4 two to a byte, low nibble first) | the scales]."""
    if wire == torch.int4:
        biased = (q + 8).to(torch.uint8).view(-1, 2)
        values = biased[:, 0] | (biased[:, 1] << 4)
    else:
        values = q.view(torch.uint8)
    return torch.cat([values, scales.contiguous().view(torch.uint8)])


def _unpack(part: torch.Tensor, length: int, dtype, wire) -> tuple[torch.Tensor, torch.Tensor]:
    count = length if wire == torch.int8 else length // 2
    values, scales = part[:count], part[count:].view(dtype)
    if wire == torch.int8:
        return values.view(torch.int8), scales
    q = torch.stack([(values & 15), (values >> 4)], dim=1).view(-1).to(torch.int8) - 8
    return q, scales
