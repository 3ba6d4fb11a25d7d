"""Train through failures under `phalanx run --on-failure continue`: the script the tests of
tests/test_keep_going.py start, written as a user would (an epoch loop over px.data_loader,
a px.save after every step (or every K), the README's resume lines), plus ways to fail on
purpose.

    keep_going.py OUT CKPT_DIR [--strategy ddp] [--precision fp32] [--epochs 3] [--sleep S]
        [--kill RANK@STEP,...] [--raise RANK@STEP] [--raise-in forward|backward] [--catch]
        [--die-in-save RANK@STEP] [--die-completing STEP] [--die-joining]
        [--die-admitting RANK] [--skip STEP] [--no-resume] [--save-every K]
        [--freeze RANK@STEP] [--samples N] [--ticks] [--timeout S] [--wait-for-joiner STEP]
        [--shard-size K] [--frozen-layers a,b,c]
        [--eval-every K] [--kill-in-eval RANK@STEP@BATCH] [--eval-where end|top]

float64; a global batch of 12 samples (4 per rank at 3 ranks), so 1, 2, 3, 4 and 6 ranks split
it evenly and any world size trains on the same samples; `--samples` of them (240: 20 steps an
epoch). Only the first worker of a rank (life 0) of the first attempt (under --on-failure
restart) fails on purpose; its replacement, or the restarted worker, runs normally.
`--raise R@S`: rank R raises an out-of-memory error in step S's backward (or forward,
`--raise-in forward`), which ends the worker, or which the loop catches (`--catch`: the step
is dropped on every rank, and the failing rank goes on through the rest of the loop's body,
its px.save included, as the others do). `--raise-in step`: in a step pre-hook of the
optimizer (registered after px.prepare), inside optimizer.step(); caught, the rank's next call
into its model raises StepFailed, which ends it. `--die-completing S`:
rank 0 dies as it completes the checkpoint of step S, the others waiting for its word. `--skip
S` leaves out the batch of step S (the reference for `--raise`). `--freeze R@S`: rank R stops
its own process (SIGSTOP) before step S's forward, a frozen rank. `--timeout S`:
`px.init(timeout=S)`. `--wait-for-joiner S`: before step S, while the job is short of a
rank, every member waits until a replacement asks to join (the next px.save admits it), so a
test that wants the replacement in waits for that event rather than for a clock.
`--frozen-layers L,...`: those of the model's Linear layers (a, b, c, input to output) are
frozen (requires_grad off) before px.prepare; the optimizer is still given every parameter.
Rank 0 writes the final weights (one flat tensor) to OUT. Every worker prints `START rank=R
pid=P life=L` and `END rank=R pid=P life=L world=W`; a fault on purpose is first a line `FAULT
rank=R kind=K step=S t=TIME`, and `--ticks` prints `TICK rank=R pid=P life=L attempt=A step=S
world=W t=TIME` after each optimizer step (benchmarks/fault_soak.py reads them).

`--eval-every K`: after every K-th step (after its save) the ranks evaluate, as a user would:
forwards under torch.no_grad() over an evaluation set of 30 samples through px.data_loader(...,
shuffle=False) (a global batch of 6: 5 batches), the per-sample losses of each batch gathered
with px.gather_for_metrics; every worker then prints `EVAL rank=R life=L step=S n=N sum=X`, the
samples its gathers held and their losses' sum (repr: every digit). `--kill-in-eval R@S@B`:
rank R SIGKILLs itself before the forward of batch B of the evaluation after step S (S counts
steps taken: `--eval-every 5` evaluates after S = 5, 10, ...). `--eval-where top`: the
evaluation after step S is made at the top of the next iteration instead, with its batch
already taken from the training loader (a step in flight: one that cannot be redone), and none
after the last step.
"""

import argparse
import os
import signal
import time

import torch

import phalanx as px

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("ckpt")
parser.add_argument("--strategy", default="ddp")
parser.add_argument("--shard-size", type=int, default=None)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--kill", default="")
parser.add_argument("--raise", dest="raise_at", default=None)
parser.add_argument("--die-in-save", default=None)
parser.add_argument("--die-completing", type=int, default=None)
parser.add_argument("--die-joining", action="store_true")
parser.add_argument("--die-admitting", type=int, default=None)
parser.add_argument("--skip", type=int, default=None)
parser.add_argument("--no-resume", action="store_true")
parser.add_argument("--save-every", type=int, default=1)
parser.add_argument("--freeze", default="")
parser.add_argument("--raise-in", choices=("forward", "backward", "step"), default="backward")
parser.add_argument("--catch", action="store_true")
parser.add_argument("--samples", type=int, default=240)
parser.add_argument("--ticks", action="store_true")
parser.add_argument("--timeout", type=float, default=None)
parser.add_argument("--wait-for-joiner", type=int, default=None)
parser.add_argument("--eval-every", type=int, default=0)
parser.add_argument("--kill-in-eval", default="")
parser.add_argument("--eval-where", choices=("end", "top"), default="end")
parser.add_argument("--frozen-layers", default="")
args = parser.parse_args()

px.init(**({} if args.timeout is None else {"timeout": args.timeout}))
rank = int(os.environ.get("RANK", "0"))  # the launch rank: a replacement keeps it
life = int(os.environ.get("PHALANX_JOINING", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
first = life == 0 and attempt == 0  # the worker that fails on purpose
print(f"START rank={rank} pid={os.getpid()} life={life}", flush=True)


def at(text):
    return {tuple(map(int, item.split("@"))) for item in text.split(",") if item} if text else set()


def say_fault(kind):
    print(f"FAULT rank={rank} kind={kind} step={where['now']} t={time.time():.4f}", flush=True)


def die():
    say_fault("kill")
    os.kill(os.getpid(), signal.SIGKILL)


kills, raises, saves = at(args.kill), at(args.raise_at), at(args.die_in_save)
freezes, eval_kills = at(args.freeze), at(args.kill_in_eval)
where = {"step": 0, "now": 0}  # steps taken (the loop's count), the step in progress
if first and saves:  # killed while writing its file of that step's checkpoint
    import phalanx.checkpoint.saving as saving

    write = saving.write_tensors

    def write_or_die(*a, **k):
        if (rank, where["now"]) in saves:
            die()
        return write(*a, **k)
    saving.write_tensors = write_or_die
if first and rank == 0 and args.die_completing is not None:  # rank 0, completing a save
    import phalanx.checkpoint.saving as saving

    complete = saving._complete

    def complete_or_die(*a, **k):
        if where["now"] == args.die_completing:
            die()
        return complete(*a, **k)
    saving._complete = complete_or_die
if life == 1 and args.die_joining:  # the replacement dies while loading the others' state
    import phalanx.checkpoint.api as api

    api.load_checkpoint = lambda *a, **k: die()
if first and args.die_admitting == rank:  # dies while admitting a replacement
    import phalanx.continuing as continuing
    import phalanx.continuing.joining as joining

    sync = joining.sync_engines

    def sync_or_die(comm):
        if any(other > 0 for _, other in continuing.now().membership.members):
            die()
        return sync(comm)
    joining.sync_engines = sync_or_die


def boom(part):
    """Raise in `part` of this step on one rank (as an out-of-memory error would)."""
    if first and (rank, where["now"]) in raises and args.raise_in == part:
        say_fault("caught" if args.catch else "raise")
        raise RuntimeError("CUDA out of memory (simulated)")


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        boom("forward")
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        boom("backward")
        return grad


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.c(Boom.apply(torch.tanh(self.b(torch.tanh(self.a(x))))))


torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(args.samples, 8, generator=g),
                                      torch.randn(args.samples, 1, generator=g))
model = Net()
for name in filter(None, args.frozen_layers.split(",")):  # frozen before px.prepare
    getattr(model, name).requires_grad_(False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
model, optimizer = px.prepare(model, optimizer, strategy=args.strategy, shard_size=args.shard_size,
                              precision=args.precision)
loader = px.data_loader(data, batch_size=12 // int(os.environ.get("WORLD_SIZE", "1")))
eval_data = torch.utils.data.TensorDataset(torch.randn(30, 8, generator=g),
                                           torch.randn(30, 1, generator=g))
eval_loader = px.data_loader(eval_data, batch_size=6 // int(os.environ.get("WORLD_SIZE", "1")),
                             shuffle=False)
optimizer.register_step_pre_hook(lambda opt, a, k: boom("step"))


def evaluate():
    """Every sample's loss, gathered batch by batch: the count and the sum this rank holds."""
    losses = []
    with torch.no_grad():
        for batch, (x, y) in enumerate(eval_loader):
            if first and (rank, where["step"], batch) in eval_kills:
                die()
            losses.append(px.gather_for_metrics(((model(x) - y) ** 2).mean(dim=1), eval_loader))
    losses = torch.cat(losses)
    print(f"EVAL rank={rank} life={life} step={where['step']} n={losses.numel()} "
          f"sum={losses.sum().item()!r}", flush=True)


start = 0
if not args.no_resume:
    ckpt = px.latest_checkpoint(args.ckpt)
    if ckpt is not None:
        saved = px.load(ckpt, model=model, optimizer=optimizer, sampler=loader.sampler)
        start, where["step"] = saved["epoch"], saved["step"]
for epoch in range(start, args.epochs):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        step = where["now"] = where["step"]
        if args.eval_where == "top" and args.eval_every and step and step % args.eval_every == 0:
            evaluate()
        if first and (rank, step) in kills:
            die()
        if first and (rank, step) in freezes:
            say_fault("freeze")
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == args.wait_for_joiner and px.world_size() < int(os.environ["WORLD_SIZE"]):
            from phalanx.continuing import now
            from phalanx.continuing.joining import requests

            while not requests(now().membership):  # the job's timeout ends a wait that never ends
                time.sleep(0.05)
        where["step"] += 1
        if step == args.skip:
            continue
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
        except RuntimeError as exc:
            if not (args.catch and "(simulated)" in str(exc)):
                raise
            # the step is dropped on every rank (optimizer.step() below changes nothing); the
            # rest of the loop (its tick, its px.save) goes on here as on the other ranks
        try:
            optimizer.step()
        except RuntimeError as exc:
            if not (args.catch and "(simulated)" in str(exc)):
                raise
        optimizer.zero_grad()
        if args.ticks:
            print(f"TICK rank={rank} pid={os.getpid()} life={life} attempt={attempt} "
                  f"step={step} world={px.world_size()} t={time.time():.4f}", flush=True)
        event = {k: v for k, v in px.step_stats(model).items() if k.startswith("membership/")}
        if event:  # the step report of the step after a change of members says so
            print(f"EVENT {' '.join(f'{k}={v}' for k, v in sorted(event.items()))}", flush=True)
        time.sleep(args.sleep)  # room for a kill from outside to land anywhere in a step
        if where["step"] % args.save_every == 0:
            px.save(os.path.join(args.ckpt, f"step{where['step']:05d}"), model=model,
                    optimizer=optimizer, sampler=loader.sampler, epoch=epoch,
                    step=where["step"], keep_last=2)
        if args.eval_where == "end" and args.eval_every and where["step"] % args.eval_every == 0:
            evaluate()
# the full values, as one process holds them (under zero3 the parameters exist only while
# their unit computes; state_dict() reads the peers' shards)
weights = torch.cat([v.reshape(-1) for v in px.unwrap(model).state_dict().values()])
if px.rank() == 0:
    torch.save(weights, args.out)
print(f"END rank={rank} pid={os.getpid()} life={life} world={px.world_size()}", flush=True)
px.shutdown()
