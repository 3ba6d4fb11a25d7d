"""px.linear_cross_entropy against F.cross_entropy over the head's logits: the peak memory a
causal LM's loss adds (forward and backward of the head and the loss) and its time, in one run.

    .venv/bin/python benchmarks/sliced_loss.py                       # Llama 3's vocabulary
    .venv/bin/python benchmarks/sliced_loss.py --tokens 512 --rounds 3

The head: Llama 3's vocabulary (128256 entries) over a hidden size of 256 (a small width, so that
a CPU computes it in seconds; the logits, what the loss is about, have Llama 3's size per
token), `--tokens` tokens (1024), fp32 and bf16 (the hidden states and the head in bf16, the
loss in fp32 as a causal LM upcasts its logits), one thread. Each measurement runs in a forked
process of its own, from a collected and trimmed heap with the high-water mark reset
(/proc/self/clear_refs), so the rise of the peak resident set (VmHWM) is what that loss adds as
a user sees it; the hidden states, the head and its gradient are made before the mark. Rounds
alternate the two losses; reported: the median rise and time of each, and their ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import multiprocessing as mp
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from peak_rss import _reset_peak, _status

import phalanx as px

VOCAB, HIDDEN = 128256, 256


def _measure(kind: str, dtype: str, tokens: int, out) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(dt)
    head.weight.grad = torch.zeros_like(head.weight)  # made before the mark: any head makes it
    hidden = torch.randn(tokens, HIDDEN, dtype=dt, requires_grad=True)
    labels = torch.randint(0, VOCAB, (tokens,))

    def step():
        if kind == "sliced":
            loss = px.linear_cross_entropy(hidden, head, labels)
        else:
            loss = F.cross_entropy(head(hidden).float(), labels)
        loss.backward()
        return loss.item()

    step()  # warm: kernels, the allocator's first blocks
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    _reset_peak()
    before = _status("VmHWM")
    start = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - start
    out.put((_status("VmHWM") - before, seconds, loss))


def _run(kind, dtype, tokens):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(kind, dtype, tokens, q))
    p.start()
    result = q.get(timeout=600)
    p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}; torch {torch.__version__}; "
          f"vocabulary {VOCAB}, hidden {HIDDEN}, {args.tokens} tokens, one thread")
    print(f"{'dtype':6} {'loss':8} {'peak rise (MB)':>15} {'time (s)':>9}   loss value")
    for dtype in ("float32", "bfloat16"):
        seen = {"plain": [], "sliced": []}
        for r in range(args.rounds):
            order = ("plain", "sliced") if r % 2 == 0 else ("sliced", "plain")
            for kind in order:
                seen[kind].append(_run(kind, dtype, args.tokens))
        med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
                   v[0][2]) for k, v in seen.items()}
        for kind, (rise, seconds, value) in med.items():
            print(f"{dtype:6} {kind:8} {rise / 1e6:15.1f} {seconds:9.2f}   {value:.6f}")
        print(f"{dtype:6} sliced/plain: memory {med['sliced'][0] / med['plain'][0]:.3f}, "
              f"time {med['sliced'][1] / med['plain'][1]:.2f}")


if __name__ == "__main__":
    main()
