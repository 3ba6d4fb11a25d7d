"""The checks of benchmarks/gpu_accept.py for `px.prepare(..., offload=...)` (engine/offload.py):
what a rank allocates on the GPU against the formula's device share, and the step time against
FSDP2's `CPUOffloadPolicy` on the same model.

The formula's device share, per rank, for Psi parameters on N ranks in bf16 with AdamW (w = g
= 2 bytes; the fp32 master and the two moments, 12 bytes, on the host):

    zero3, no offload           (g + 12) Psi / N       (between steps the bf16 parameters
                                                        exist only while gathered)
    zero2, offload="optimizer"  w Psi                  (full bf16 parameters; the gradient
                                                        shards go to the host in backward)
    zero3, offload="optimizer"  w Psi / N              (the bf16 shard it gathers from)
    zero3, offload="params"     0                      (the shard lives on the host too)

plus the engine's pool of two full-gradient buffers (zero2 and zero3: each the largest unit's
bf16 gradient), which the check reads from the engine rather than assume.
"""

from __future__ import annotations

import gc
import os

import torch

CASES = (("zero3", None), ("zero2", "optimizer"), ("zero3", "optimizer"), ("zero3", "params"))


def _device_share(strategy: str, offload, psi: int, n: int) -> float:
    """The formula's bytes per rank on the device (see the module's docstring)."""
    if offload is None:
        return 14 * psi / n
    if offload == "optimizer":  # the gradient shards on the host (engine/offload.py)
        return 2 * psi if strategy == "zero2" else 2 * psi / n
    return 0.0


def _memory_rank(dry: bool) -> dict:
    """On each of 2 ranks: allocated between steps for every case of CASES, after 2 steps of
    batch 4 (the model: GPT-2 124M, TINY on the CPU dry run)."""
    from gpt import n_params
    from gpu_common import gpt, train

    import phalanx as px
    from phalanx.testing import engine_of
    out = {}
    dev = px.device()
    for strategy, offload in CASES:
        model, config = gpt("gpt2", dry)
        psi = n_params(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = px.prepare(model, opt, strategy=strategy, precision="bf16", offload=offload,
                                step_stats=False)
        train(model, opt, config, 2, dev)
        pool = engine_of(model).pool
        pool_bytes = sum(t.numel() * t.element_size() for t in pool.tensors()) if pool else 0
        if dev.type == "cuda":
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
        else:  # the dry run: what the engine holds on the "device" side, counted by hand
            engine = engine_of(model)
            device_side = [t for u in engine.all_units for t in (
                u.flat, u.grad_shard, None if u.shards_on_host else u.kept,
                None if u.shards_on_host else u.frozen_shard,
                u.master if u.host is None else None) if t is not None]
            if engine.host_link is None:
                device_side += [t for s in opt.state.values() for t in s.values()
                                if torch.is_tensor(t)]
            allocated = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                             for t in device_side}.values()) + pool_bytes
        out[f"{strategy} {offload}"] = (allocated, _device_share(strategy, offload, psi, 2),
                                        pool_bytes)
        del model, opt, pool
        gc.collect()
        px.barrier()  # a dropped model's engine goes at the next blocking collective
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def register_offload_checks(check, verdict, gpt, one_group):

    @check("offload-memory")
    def offload_memory(dry):
        """GPT-2 124M bf16 AdamW, 2 ranks sharing the GPU (gloo with CUDA tensors): each
        rank's allocated bytes between steps against the formula's device share plus the
        gradient pool, with offload="optimizer" (zero2, zero3) and offload="params" (zero3),
        beside zero3 without offload."""
        from phalanx.launch.spawn import run_workers
        if not dry:
            os.environ.update(PHALANX_BACKEND="gloo", PHALANX_DEVICE="cuda")
        ranks = run_workers(_memory_rank, 2, (dry,), timeout=400, start_method="spawn")
        ratios, shown = {}, []
        for case in ranks[0]:
            allocated = max(r[case][0] for r in ranks)
            share, pool = ranks[0][case][1], ranks[0][case][2]
            ratios[case] = allocated / (share + pool)
            shown.append(f"{case}: {allocated / 2**20:.0f} MiB ({ratios[case]:.3f})")
        ok = all(0.97 <= r <= 1.10 for r in ratios.values())
        return verdict(ok or dry, max(ratios.values()),
                       "allocated between steps / (formula + pool), each in 0.97-1.10: "
                       + "; ".join(shown))

    @check("offload-step-time-vs-fsdp2", dry=False)
    def offload_step_time(dry):
        """GPT-2 124M bf16, batch 8 x 1024, world 1: phalanx with offload="optimizer" (zero2:
        bf16 parameters on the GPU, fp32 masters and AdamW on the host, stepped there) against
        FSDP2 with `CPUOffloadPolicy` (parameters, gradients and AdamW on the host; its gathers
        copy the parameters up), both AdamW with fused=True; and the host step's share of
        phalanx's step from its step report."""
        from gpt import tokens
        from gpu_common import _timed
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )

        import phalanx as px
        one_group("nccl")
        dev = torch.device("cuda", 0)
        x, y = tokens(gpt("gpt2", dry)[1], 8, seed=0, device=dev)

        def loop(model, opt):
            def step():
                model(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step

        ours, _ = gpt("gpt2", dry)
        ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True)
        ours, ours_opt = px.prepare(ours, ours_opt, strategy="zero2", precision="bf16",
                                    offload="optimizer", step_stats=False)
        t_ours = _timed(loop(ours, ours_opt))
        del ours, ours_opt
        gc.collect()
        torch.cuda.empty_cache()
        fsdp, _ = gpt("gpt2", dry)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        for block in fsdp.h:
            fully_shard(block, mp_policy=policy, offload_policy=CPUOffloadPolicy())
        fully_shard(fsdp, mp_policy=policy, offload_policy=CPUOffloadPolicy())
        fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4, fused=True)
        t_fsdp = _timed(loop(fsdp, fsdp_opt))
        del fsdp, fsdp_opt
        gc.collect()
        torch.cuda.empty_cache()
        reported, _ = gpt("gpt2", dry)  # the share of the host step, from the step report
        reported_opt = torch.optim.AdamW(reported.parameters(), lr=1e-4, fused=True)
        reported, reported_opt = px.prepare(reported, reported_opt, strategy="zero2",
                                            precision="bf16", offload="optimizer")
        for _ in range(4):
            loop(reported, reported_opt)()
        report = px.step_stats(reported)
        share = report["host_step_s"] / report["wall_s"]
        ratio = t_ours / t_fsdp
        return verdict(ratio <= 1.0, ratio,
                       f"phalanx offload='optimizer' / FSDP2 CPUOffloadPolicy (<= 1); ms: "
                       f"phalanx {t_ours * 1e3:.1f}, FSDP2 {t_fsdp * 1e3:.1f}; host step "
                       f"{report['host_step_s'] * 1e3:.1f} ms, {share:.0%} of the step")
