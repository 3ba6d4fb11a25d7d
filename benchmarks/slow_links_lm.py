"""What each remedy for slow links buys: a small language model trained over a 1 Gbit/s link, on a
cluster of namespaces on this machine (phalanx.testing.cluster).

    .venv/bin/python benchmarks/slow_links_lm.py                 # needs root (ip netns, tc)
    .venv/bin/python benchmarks/slow_links_lm.py --rates 1gbit 10gbit --rounds 3 --steps 25

Two nodes of one rank each (gloo, one thread per rank), each node's launcher `phalanx run
--nnodes 2 --node-rank R`, as on a real cluster. The model is a GPT of nanoGPT's shape
(benchmarks/gpt.py: 4 blocks, width 384, vocabulary 2048, context 64; 7.9M parameters, 32 MB of
fp32 gradients a step), AdamW lr 1e-3, 4 sequences per rank and step. The data is made here: a
language whose every token has four successors, drawn with probabilities 0.5, 0.25, 0.15 and 0.1
(1.21 nats per token is the best any model can do; ln 2048 = 7.62 is where training starts).
Step k of every competitor reads the same global batch.

Every competitor trains its own copy from the same initial weights, in the same processes,
taking turns in rotating order, `--steps` steps a turn; round 0 warms up (and trains). A step's
time is the slowest rank's, averaged over the timed rounds (a DiLoCo sync lands in some steps
only, so the mean and not the median); the bytes sent are the step report's, averaged over every
step but a turn's first. The compute-only bound is the same forward, backward and
step with no communication at all. At the end every competitor's held-out loss is measured on
the same 8 batches (the mean of the ranks' losses, which under DiLoCo hold the synced weights
when the step count is a multiple of H).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
VOCAB, CONTEXT, BATCH = 2048, 64, 4
SUCCESSORS = torch.tensor([0.5, 0.25, 0.15, 0.1])


def config():
    sys.path.insert(0, str(HERE.parent))
    from gpt import Config
    return Config(n_layer=4, n_head=6, n_embd=384, vocab=VOCAB, block=CONTEXT)


def successor_table() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.stack([torch.randperm(VOCAB, generator=g)[:len(SUCCESSORS)]
                        for _ in range(VOCAB)])


def batch(table: torch.Tensor, seed: int, size: int = BATCH):
    """`size` sequences of the made language, the inputs and the targets shifted by one."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(size, CONTEXT + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (size,), generator=g)
    choice = torch.multinomial(SUCCESSORS, size * CONTEXT, replacement=True,
                               generator=g).view(size, CONTEXT)
    for t in range(CONTEXT):
        seq[:, t + 1] = table[seq[:, t], choice[:, t]]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def competitors(px, only: list[str] | None = None) -> dict:
    """name -> keyword arguments of px.prepare (None: compute only), those named in `only`
    (all by default). A remedy whose name this phalanx does not have is left out."""
    out = {"compute-only": None, "ddp": {}, "ddp bf16 comm": {"comm_dtype": torch.bfloat16}}
    if hasattr(px, "PowerSGD"):
        for r in (4, 8, 16, 32):
            out[f"powersgd r{r}"] = {"compression": px.PowerSGD(rank=r, start_step=10)}
    if hasattr(px, "DiLoCo"):
        for h in (20, 50):
            out[f"diloco H={h}"] = {"strategy": px.DiLoCo(sync_every=h, outer_lr=0.7,
                                                          outer_momentum=0.9)}
    try:
        import inspect
        if "staleness" in inspect.signature(px.prepare).parameters:
            out["staleness=1"] = {"staleness": 1}
    except (TypeError, ValueError):
        pass
    if only:
        out = {name: kwargs for name, kwargs in out.items() if name in only}
    else:
        for r in (8, 16, 32):
            out.pop(f"powersgd r{r}")
    return out


def worker(rounds: int, steps: int, only: list[str] | None) -> None:
    import torch.distributed as dist
    from gpt import GPT

    import phalanx as px

    px.init()
    torch.set_num_threads(1)
    table = successor_table()
    c = config()
    runs = {}
    for name, kwargs in competitors(px, only).items():
        torch.manual_seed(0)
        model = GPT(c)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if kwargs is not None:
            model, opt = px.prepare(model, opt, **kwargs)
        runs[name] = (model, opt)
    names = list(runs)
    times = {name: [] for name in names}
    sent = {}
    world, rank = px.world_size(), px.rank()
    done = {name: 0 for name in names}
    for r in range(rounds + 1):  # round 0 warms up
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            model, opt = runs[name]
            dist.barrier()
            start = time.perf_counter()
            for i in range(steps):
                x, y = batch(table, seed=done[name] * world + rank)
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                done[name] += 1
                # The step report's bytes of this step, summed; a turn's first step is left
                # out: its report spans the other competitors' turns since this one's last
                # step (their collectives are on the same group).
                if name != "compute-only" and i > 0:
                    total, count = sent.get(name, (0, 0))
                    sent[name] = (total + px.step_stats(model).get("comm_bytes", 0), count + 1)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r > 0:
                times[name].append(elapsed.item() / steps)
    losses = {}
    held_out = [batch(table, seed=10**6 + i) for i in range(8)]
    for name in names:
        model, _ = runs[name]
        with torch.no_grad():
            mine = torch.tensor([statistics.mean(model(x, y).item() for x, y in held_out)])
        dist.all_reduce(mine)
        losses[name] = mine.item() / world
    if rank == 0:
        sent = {name: total / count for name, (total, count) in sent.items()}
        print("RESULT " + json.dumps({"times": times, "sent": sent, "losses": losses,
                                      "steps": done}), flush=True)
    px.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="these competitors only (with compute-only and ddp: the ratios' "
                             "bases), e.g. --only 'powersgd r4' 'powersgd r8'")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = None if not args.only else ["compute-only", "ddp", *args.only]
    if args.worker:
        sys.path.insert(0, str(HERE.parent))
        worker(args.rounds, args.steps, only)
        return
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from phalanx.testing.cluster import Cluster, unavailable

    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return
    total = (args.rounds + 1) * args.steps
    print(f"2 nodes x 1 rank, GPT 7.9M (32 MB fp32 gradients), AdamW, {BATCH} x {CONTEXT} "
          f"tokens per rank, {total} steps each")
    print(f"{'link':7} {'competitor':14} {'step s':>7} {'of bound':>9} {'vs ddp':>7} "
          f"{'sent MB/step':>13} {'loss':>7} {'loss/ddp':>9}")
    for rate in args.rates:
        with Cluster(nodes=2, rate=None if rate == "none" else rate) as cluster:
            nodes = cluster.launch([str(HERE), "--worker", "--rounds", str(args.rounds),
                                    "--steps", str(args.steps)]
                                   + (["--only", *args.only] if args.only else []),
                                   timeout=3000)
        for node, finished in enumerate(nodes):
            if finished.returncode != 0:
                raise SystemExit(f"node {node} failed:\n{finished.stderr[-3000:]}")
        line = next(l for l in nodes[0].stdout.splitlines() if "RESULT " in l)
        result = json.loads(line.split("RESULT ", 1)[1])
        mean = {name: statistics.mean(t) for name, t in result["times"].items()}
        bound, ddp = mean["compute-only"], mean["ddp"]
        for name, t in mean.items():
            sent = result["sent"].get(name)
            sent_text = "-" if sent is None else f"{sent / 1e6:.2f}"
            loss = result["losses"][name]
            print(f"{rate:7} {name:14} {t:7.3f} {bound / t:9.2f} {ddp / t:7.2f} "
                  f"{sent_text:>13} {loss:7.3f} {loss / result['losses']['ddp']:9.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
