"""What the GPU checks share (benchmarks/gpu_checks.py and the modules that register checks
beside it, gpu_checks_nccl.py and gpu_checks_offload.py): the registry of checks, a verdict,
the device, the GPT under test, a training loop and a timer. Each check module imports it, so
none imports another."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


@dataclass
class Check:
    fn: object
    gpus: int = 1      # GPUs it needs
    dry: bool = True   # whether --cpu-dry-run runs it


CHECKS: dict[str, Check] = {}


def check(name, gpus=1, dry=True):
    def register(fn):
        CHECKS[name] = Check(fn, gpus, dry)
        return fn
    return register


def verdict(ok: bool, value, detail: str) -> dict:
    return {"verdict": "PASS" if ok else "FAIL", "value": value, "detail": detail}


def device(dry: bool) -> torch.device:
    return torch.device("cpu") if dry else torch.device("cuda", 0)


def deterministic() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def gpt(config_name: str, dry: bool, dtype=torch.float32, seed=0):
    from gpt import GPT, GPT2_124M, SMALL, TINY
    config = TINY if dry else {"tiny": TINY, "small": SMALL, "gpt2": GPT2_124M}[config_name]
    torch.manual_seed(seed)
    return GPT(config).to(dtype), config


def one_group(backend: str) -> None:
    """A process group of one (FSDP2 and a Comm need a group even alone)."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)


def train(model, opt, config, steps, dev, batch=4, first=0):
    from gpt import tokens
    losses = []
    for step in range(first, first + steps):
        x, y = tokens(config, batch, seed=step, device=dev)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def state(model) -> dict:
    """The full state of a model, prepared (its masters: under zero3 its parameters hold values
    only while they compute) or plain."""
    return {k: v.detach().double().cpu() for k, v in model.state_dict().items()}


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


# -- parity ---------------------------------------------------------------------------------


def _timed(step, n=20, warmup=5, cuda=True):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def state_bytes(opt) -> int:
    """Bytes of an optimizer's state, a torchao quantized state by its codes and scales."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if type(v) is torch.Tensor:
                total += v.numel() * v.element_size()
            elif isinstance(v, torch.Tensor):  # torchao's quantized state
                total += sum(t.numel() * t.element_size() for t in (v.codes, v.scale))
    return total
