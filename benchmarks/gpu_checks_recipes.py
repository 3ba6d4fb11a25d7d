"""The checks of benchmarks/gpu_accept.py for the founding example's recipes (docs/guides/
fine-tuning.md): what a rank allocates on the GPU under zero3 with bf16-true, with torchao's
AdamW8bit on top, and the peak that step_in_backward saves.

The formula, per rank, between steps, for Psi parameters on N ranks with AdamW:

    zero3, bf16-true              (2 + 4) Psi / N     (bf16 shard, two bf16 moments)
    zero3, bf16-true + AdamW8bit  (2 + 2) Psi / N     (bf16 shard, two 8-bit moments; their
                                                       block scales, 1/64 more, are counted)

and step_in_backward lowers the peak of a step (forward, backward, step) by about the reduced
gradient shard that would otherwise wait for `optimizer.step()`: 2 Psi / N bytes in bf16.
"""

from __future__ import annotations

import gc
import os

import torch

CASES = ("bf16-true", "bf16-true+8bit", "bf16", "bf16+step_in_backward")


def _recipes_rank(dry: bool) -> dict:
    """On each of 2 ranks: allocated between steps and the peak of a step, for each case (the
    model: GPT-2 124M, TINY on the CPU dry run)."""
    from gpt import n_params
    from gpu_common import gpt, state_bytes, train

    import phalanx as px
    from phalanx.testing import engine_of
    out = {}
    dev = px.device()
    for case in CASES:
        if case.endswith("8bit"):
            try:
                from torchao.optim import AdamW8bit
            except ImportError:
                continue
        model, config = gpt("gpt2", dry)
        psi = n_params(model)
        opt = AdamW8bit(model.parameters(), lr=1e-4) if case.endswith("8bit") else \
            torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = px.prepare(model, opt, strategy="zero3", step_stats=False,
                                precision="bf16-true" if case.startswith("bf16-true") else "bf16",
                                step_in_backward=case.endswith("step_in_backward"))
        train(model, opt, config, 2, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated()
            train(model, opt, config, 1, dev, first=2)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:  # the dry run: the engine's shards and the state, counted by hand
            engine = engine_of(model)
            allocated = sum(u.master.numel() * u.master.element_size()
                            for u in engine.units) + state_bytes(opt)
            peak = allocated
        out[case] = (allocated, peak, psi)
        del model, opt
        gc.collect()
        px.barrier()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def register_recipe_checks(check, verdict):

    @check("recipes-memory")
    def recipes_memory(dry):
        """GPT-2 124M, zero3, 2 ranks sharing the GPU (gloo with CUDA tensors): allocated
        between steps against the formula for bf16-true (6 Psi / N) and bf16-true with
        torchao's AdamW8bit (4 Psi / N, with the block scales), each in 0.97-1.15; and the
        peak of a step with step_in_backward at least 0.8 x (2 Psi / N) below bf16's."""
        from phalanx.launch.spawn import run_workers
        if not dry:
            os.environ.update(PHALANX_BACKEND="gloo", PHALANX_DEVICE="cuda")
        ranks = run_workers(_recipes_rank, 2, (dry,), timeout=600, start_method="spawn")
        got = {case: (max(r[case][0] for r in ranks), max(r[case][1] for r in ranks),
                      ranks[0][case][2]) for case in ranks[0]}
        shown, ok = [], True
        for case, per_param in (("bf16-true", 6.0), ("bf16-true+8bit", 4.0 + 4.0 / 128)):
            if case not in got:
                shown.append(f"{case}: skipped (no torchao)")
                continue
            allocated, _, psi = got[case]
            ratio = allocated / (per_param * psi / 2)
            ok = ok and 0.97 <= ratio <= 1.15
            shown.append(f"{case}: {allocated / 2**20:.0f} MiB ({ratio:.3f} of the formula)")
        saved = got["bf16"][1] - got["bf16+step_in_backward"][1]
        shard = 2 * got["bf16"][2] / 2
        ok = ok and saved >= 0.8 * shard
        shown.append(f"step_in_backward's peak {saved / 2**20:.0f} MiB below bf16's "
                     f"(gradient shard {shard / 2**20:.0f} MiB)")
        return verdict(ok or dry, saved / shard if shard else None, "; ".join(shown))

    @check("sliced-loss-memory")
    def sliced_loss_memory(dry):
        """One process, Llama 3's head in bf16 (128256 x 4096) over 2048 tokens: the peak the
        loss adds (forward and backward of head and loss, the weight's gradient made before
        the mark) with px.linear_cross_entropy at most 0.35 x F.cross_entropy's over the
        logits (the plan's loss terms: 0.14 GiB against 2.94 GiB, each beside the 0.98 GiB of
        the weight's gradient as autograd makes it), and the two losses within 1e-3 of each
        other."""
        import torch.nn.functional as F

        import phalanx as px
        dev = torch.device("cuda" if not dry and torch.cuda.is_available() else "cpu")
        vocab, hidden, tokens = (128256, 4096, 2048) if dev.type == "cuda" else (1024, 32, 64)
        torch.manual_seed(0)
        head = torch.nn.Linear(hidden, vocab, bias=False, device=dev, dtype=torch.bfloat16)
        head.weight.grad = torch.zeros_like(head.weight)
        h = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,), device=dev)
        rises, values = {}, {}
        for kind in ("plain", "sliced"):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            loss = px.linear_cross_entropy(h, head, labels) if kind == "sliced" else \
                F.cross_entropy(head(h).float(), labels)
            loss.backward()
            values[kind] = loss.item()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                rises[kind] = torch.cuda.max_memory_allocated() - before
            h.grad = None
        ratio = rises["sliced"] / rises["plain"] if rises else None
        close = abs(values["sliced"] - values["plain"]) <= 1e-3 * abs(values["plain"])
        ok = close and (dry or ratio <= 0.35)
        return verdict(ok, ratio, f"losses {values['plain']:.5f} and {values['sliced']:.5f}"
                       + (f"; peak rise {rises['sliced'] / 2**20:.0f} MiB against "
                          f"{rises['plain'] / 2**20:.0f} MiB" if rises else " (dry run)"))
