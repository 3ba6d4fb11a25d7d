"""The checks of benchmarks/gpu_accept.py, one function each: `fn(dry) -> {verdict, value,
detail}`. `dry` runs the same code on the CPU at small sizes (to exercise it, not to judge).

Each runs in a fresh interpreter. Checks with two ranks on one GPU use gloo with CUDA tensors
(PHALANX_BACKEND=gloo PHALANX_DEVICE=cuda): NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from gpu_common import (
    CHECKS,  # noqa: F401 (what gpu_accept.py and the tests read here)
    STRATEGIES,
    _timed,
    check,
    deterministic,
    device,
    gpt,
    max_rel,
    one_group,
    state,
    train,
    verdict,
)


@check("parity-fp32-world1")
def parity_fp32(dry):
    """Every strategy at world 1, fp32, against plain PyTorch: bit for bit."""
    import phalanx as px
    deterministic()
    dev = device(dry)
    ref, config = gpt("small", dry)
    ref = ref.to(dev)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    train(ref, opt, config, 10, dev)
    want, worst = state(ref), 0.0
    for strategy in STRATEGIES:
        model, _ = gpt("small", dry)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = px.prepare(model, opt, strategy=strategy)
        train(model, opt, config, 10, dev)
        worst = max(worst, max_rel(state(model), want))
    return verdict(worst == 0.0, worst, "max relative difference over 4 strategies; target 0")


@check("parity-bf16-vs-fsdp2", dry=False)
def parity_bf16(dry):
    """bf16 at world 1 against FSDP2 with the same policy (bf16 parameters, fp32 output)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import phalanx as px
    deterministic()
    one_group("nccl")
    dev = device(dry)
    ref, config = gpt("small", dry)
    ref = ref.to(dev)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32)
    for block in ref.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(ref, mp_policy=policy)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want_losses = train(ref, opt, config, 20, dev)
    want = {k: v.full_tensor().double().cpu() for k, v in ref.state_dict().items()}
    model, _ = gpt("small", dry)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = px.prepare(model, opt, precision="bf16", step_stats=False)
    losses = train(model, opt, config, 20, dev)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    params = max_rel(state(model), want)
    return verdict(loss_rel <= 2e-3 and params <= 5e-3, params,
                   f"param rel L2 after 20 steps (<= 5e-3); loss rel per step {loss_rel:.2g} "
                   "(<= 2e-3)")


def _two_rank_f64(strategy, dry):
    """4 steps of the TINY GPT in float64, global batch 8, each rank's rows in two
    accumulation halves (the first without communication), clipped: `strategy` None is the
    one-process reference."""
    from gpt import tokens

    import phalanx as px
    distributed = strategy is not None
    torch.manual_seed(100 + (px.rank() if distributed else 0))  # rank 0's values broadcast
    model, config = gpt("tiny", True, dtype=torch.float64)
    dev = px.device()
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if distributed:
        model, opt = px.prepare(model, opt, strategy=strategy)
    world, rank = (px.world_size(), px.rank()) if distributed else (1, 0)
    rows = 8 // world
    for step in range(4):
        x, y = tokens(config, 8, seed=step, device=dev)
        for micro in range(2):
            lo = rank * rows + micro * rows // 2
            hi = lo + rows // 2
            quiet = distributed and micro == 0
            with px.no_sync(model) if quiet else _null():
                (model(x[lo:hi], y[lo:hi]) / 2).backward()
        if distributed:
            px.clip_grad_norm_(model, 0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return state(model)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@check("parity-f64-2ranks-gloo-cuda")
def parity_f64(dry):
    """float64 at 2 ranks sharing the GPU (gloo with CUDA tensors) against one process, every
    strategy with accumulation and clipping; zero3 against zero2 as well."""
    from phalanx.launch.spawn import run_workers
    if not dry:
        os.environ.update(PHALANX_BACKEND="gloo", PHALANX_DEVICE="cuda")
    want = _two_rank_f64(None, dry)
    results, worst = {}, 0.0
    for strategy in STRATEGIES:
        results[strategy] = run_workers(_two_rank_f64, 2, (strategy, dry), timeout=240,
                                        start_method="spawn")[0]
        worst = max(worst, max_rel(results[strategy], want))
    apart = max_rel(results["zero3"], results["zero2"])
    return verdict(worst <= 1e-10 and apart <= 1e-10, worst,
                   f"max rel difference to one process (<= 1e-10); zero3 to zero2 {apart:.2g}")


@check("fp16-vs-gradscaler")
def fp16(dry):
    """fp16: no more skipped steps than torch.amp's GradScaler, loss as close to fp32."""
    import phalanx as px
    dev = device(dry)
    steps = 30
    ref, config = gpt("small", dry)
    ref = ref.to(dev)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fp32 = train(ref, opt, config, steps, dev)
    amp, _ = gpt("small", dry)
    amp = amp.to(dev)
    opt = torch.optim.AdamW(amp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(dev.type)
    from gpt import tokens
    amp_losses, amp_skips = [], 0
    for step in range(steps):
        x, y = tokens(config, 4, seed=step, device=dev)
        with torch.autocast(dev.type, dtype=torch.float16):
            loss = amp(x, y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        amp_skips += scaler.get_scale() < before
        opt.zero_grad()
        amp_losses.append(float(loss))
    model, _ = gpt("small", dry)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = px.prepare(model, opt, precision="fp16")
    losses = train(model, opt, config, steps, dev)
    skips = model.loss_scaler.skipped_steps
    dev_px = abs(losses[-1] - fp32[-1]) / fp32[-1]
    dev_amp = abs(amp_losses[-1] - fp32[-1]) / fp32[-1]
    return verdict(skips <= amp_skips and dev_px <= max(0.03, dev_amp), skips,
                   f"skipped steps (GradScaler: {amp_skips}); final loss vs fp32 {dev_px:.3g} "
                   f"(GradScaler {dev_amp:.3g}, target <= 0.03)")


# -- synchronisations and speed ---------------------------------------------------------------
@check("syncs-per-step")
def syncs(dry):
    """Host reads of device values per steady step (host.py's count, and on a GPU the syncs
    torch.cuda.set_sync_debug_mode reports): at most 1, for every strategy in bf16."""
    import warnings

    import phalanx as px
    from phalanx.comm import host
    dev = device(dry)
    worst, worst_warned = 0, 0
    for strategy in STRATEGIES:
        model, config = gpt("small", dry)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        model, opt = px.prepare(model, opt, strategy=strategy, precision="bf16")
        train(model, opt, config, 3, dev)
        before = host.count()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if not dry:
                torch.cuda.set_sync_debug_mode("warn")
            train(model, opt, config, 1, dev)
            if not dry:
                torch.cuda.set_sync_debug_mode(0)
        warned = sum("synchroniz" in str(w.message).lower() for w in caught)
        worst = max(worst, host.count() - before)
        worst_warned = max(worst_warned, warned)
    # loss.item() in train() is the loop's own read: one sync of the user's
    return verdict(worst <= 1 and (dry or worst_warned <= 2), worst,
                   f"phalanx reads per step (<= 1); syncs torch reported {worst_warned} "
                   "(<= 2, one being the loop's own loss.item())")


@check("step-time-gpt2", dry=False)
def step_time(dry):
    """GPT-2 124M, bf16, batch 8 x 1024, world 1: phalanx against a hand loop (bf16 parameters,
    fp32 masters) and FSDP2 (the same policy); fp32 phalanx against plain PyTorch."""
    from gpt import tokens
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import phalanx as px
    one_group("nccl")
    dev = device(dry)
    x, y = tokens(gpt("gpt2", dry)[1], 8, seed=0, device=dev)

    def loop(model, opt, before=None, after=None):
        def step():
            model(x, y).backward()
            if before:
                before()
            opt.step()
            if after:
                after()
            opt.zero_grad(set_to_none=True)
        return step

    # the hand loop: bf16 model, fp32 masters in the optimizer
    hand, _ = gpt("gpt2", dry)
    masters = [p.detach().clone().float().requires_grad_() for p in hand.parameters()]
    hand = hand.to(dev, torch.bfloat16)
    masters = [m.to(dev) for m in masters]
    hand_opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def to_masters():
        for m, p in zip(masters, hand.parameters()):
            m.grad = p.grad.float()

    def to_params():
        with torch.no_grad():
            for m, p in zip(masters, hand.parameters()):
                p.copy_(m)
    px_model, _ = gpt("gpt2", dry)
    px_opt = torch.optim.AdamW(px_model.parameters(), lr=1e-4, fused=True)
    px_model, px_opt = px.prepare(px_model, px_opt, precision="bf16", step_stats=False)
    fsdp, _ = gpt("gpt2", dry)
    fsdp = fsdp.to(dev)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    for block in fsdp.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(fsdp, mp_policy=policy)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4, fused=True)
    t_hand = _timed(loop(hand, hand_opt, to_masters, to_params))
    t_px = _timed(loop(px_model, px_opt))
    t_fsdp = _timed(loop(fsdp, fsdp_opt))
    ratio_hand, ratio_fsdp = t_px / t_hand, t_px / t_fsdp
    return verdict(ratio_hand <= 1.02 and ratio_fsdp <= 1.0, ratio_hand,
                   f"phalanx / hand loop (<= 1.02); phalanx / FSDP2 {ratio_fsdp:.3f} (<= 1); "
                   f"ms: hand {t_hand * 1e3:.1f}, phalanx {t_px * 1e3:.1f}, "
                   f"FSDP2 {t_fsdp * 1e3:.1f}")


@check("memory-gpt2", dry=False)
def memory(dry):
    """GPT-2 124M bf16 AdamW, world 1: allocated between steps against the formula 16 Psi
    (bf16 weights and gradients, fp32 masters and two moments), peak against px.plan."""
    from gpt import n_params

    import phalanx as px
    dev = device(dry)
    model, config = gpt("gpt2", dry)
    psi = n_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = px.prepare(model, opt, precision="bf16", step_stats=False)
    train(model, opt, config, 2, dev, batch=8)
    torch.cuda.synchronize()
    between = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train(model, opt, config, 1, dev, batch=8)
    peak = torch.cuda.max_memory_allocated()
    ratio = between / (16 * psi)
    with torch.device("meta"):
        meta, _ = gpt("gpt2", dry)
    plan = px.plan(meta, gpus=1, precision="bf16", optimizer="adamw", strategy="ddp",
                   input_shape=f"8x{config.block}")["ddp"]
    vs_plan = peak / plan.total_bytes
    return verdict(0.97 <= ratio <= 1.10 and 0.85 <= vs_plan <= 1.15, ratio,
                   f"allocated between steps / 16 Psi (0.97-1.10); peak / plan {vs_plan:.3f} "
                   f"(0.85-1.15); peak {peak / 2**30:.2f} GiB")


# -- checkpoints, launching, meta builds --------------------------------------------------------
@check("checkpoint-resume")
def checkpoint(dry):
    """Save from the GPU (and in the background), load in a fresh model, resume: the same
    losses as an uninterrupted run, bit for bit; the export loads into a plain model."""
    import tempfile

    from safetensors.torch import load_file

    import phalanx as px
    deterministic()
    dev = device(dry)
    tmp = tempfile.mkdtemp()
    ok, details = True, []
    for strategy in ("ddp", "zero2", "zero3"):
        model, config = gpt("tiny", dry)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = px.prepare(model, opt, strategy=strategy, precision="bf16")
        train(model, opt, config, 3, dev)
        px.save(f"{tmp}/{strategy}", model=model, optimizer=opt, background=True)
        want = train(model, opt, config, 3, dev, first=3)
        fresh, _ = gpt("tiny", dry, seed=1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        fresh, fresh_opt = px.prepare(fresh, fresh_opt, strategy=strategy, precision="bf16")
        px.load(f"{tmp}/{strategy}", model=fresh, optimizer=fresh_opt)
        got = train(fresh, fresh_opt, config, 3, dev, first=3)
        px.export(f"{tmp}/{strategy}.safetensors", fresh)
        plain, _ = gpt("tiny", True)
        plain.load_state_dict(load_file(f"{tmp}/{strategy}.safetensors"))
        ok &= got == want
        details.append(f"{strategy} {'same' if got == want else 'differs'}")
    return verdict(ok, None, "resumed losses, bit for bit: " + ", ".join(details))


@check("spawn-and-run")
def launching(dry):
    """px.spawn after torch.cuda.is_available() with a function defined in __main__, phalanx
    run -n 1, and phalanx run -n 2 with NCCL on one GPU (a clear error, quickly)."""
    script = textwrap.dedent("""
        import torch, phalanx as px
        torch.cuda.is_available()           # what a notebook does first
        def where():                        # defined in __main__, like a notebook cell
            return str(px.device())
        print("SPAWNED", px.spawn(where, processes=1, timeout=120))
    """)
    env = dict(os.environ)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=200, env=env)
    want = "cpu" if dry else "cuda:0"
    spawned = f"SPAWNED {want}" in done.stdout
    run_script = Path(os.environ.get("TMPDIR", "/tmp")) / "phalanx_accept_where.py"
    run_script.write_text("import phalanx as px\npx.init()\nprint('RAN', px.device())\n")
    ran = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "1", str(run_script)],
                         capture_output=True, text=True, timeout=200, env=env)
    ran_ok = f"RAN {want}" in ran.stdout
    refused = True
    if not dry:
        t = time.monotonic()
        two = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2",
                              str(run_script)], capture_output=True, text=True, timeout=200,
                             env=env)
        refused = two.returncode != 0 and "needs GPU 1, but this node has 1 GPU" in two.stderr \
            and time.monotonic() - t < 60
    return verdict(spawned and ran_ok and refused, None,
                   f"px.spawn on {want}: {spawned}; phalanx run -n 1: {ran_ok}; "
                   f"-n 2 on one GPU refused clearly: {refused}")


def _meta_ranks(dry):
    import phalanx as px
    torch.manual_seed(1337 + px.rank())  # nanoGPT's per-rank seeds
    with torch.device("meta"):
        model, _ = gpt("tiny", True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.prepare(model, opt)
    return state(model)


@check("meta-build-ranks")
def meta_build(dry):
    """A meta-device build at 2 ranks with per-rank seeds: every rank holds rank 0's model."""
    from phalanx.launch.spawn import run_workers
    if not dry:
        os.environ.update(PHALANX_BACKEND="gloo", PHALANX_DEVICE="cuda")
    a, b = run_workers(_meta_ranks, 2, (dry,), timeout=240, start_method="spawn")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    return verdict(worst == 0.0, worst, "max |rank 0 - rank 1| after prepare (target 0)")


from gpu_checks_nccl import register_nccl_checks  # noqa: E402

register_nccl_checks(check, verdict, gpt, _two_rank_f64, max_rel, STRATEGIES, one_group)

from gpu_checks_offload import register_offload_checks  # noqa: E402

register_offload_checks(check, verdict, gpt, one_group)

from gpu_checks_recipes import register_recipe_checks  # noqa: E402

register_recipe_checks(check, verdict)
