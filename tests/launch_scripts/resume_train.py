"""Train, saving after every step, and resume from the newest complete checkpoint: the script
a user runs under `phalanx run --max-restarts K` to survive a crash of any rank.

    resume_train.py OUT.safetensors CKPT_DIR STEPS STRATEGY [--die-in-save STEP]

float64, data fixed by the step number, so a resumed run must end bit for bit where an
uninterrupted one does. With --die-in-save S, rank 1 kills itself (SIGKILL) while writing its
file of the checkpoint of step S, on the first attempt only. Every start prints
`START step=S attempt=A t=T` (T: time.time()).
"""

import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px

out, ckpt_dir, steps, strategy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
die_in_save = int(sys.argv[sys.argv.index("--die-in-save") + 1]) \
    if "--die-in-save" in sys.argv else None
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

px.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                      nn.Linear(64, 4)).double()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
model, opt = px.prepare(model, opt, strategy=strategy)
start = 0
latest = px.latest_checkpoint(ckpt_dir)
if latest is not None:
    start = px.load(latest, model=model, optimizer=opt)["step"]
print(f"START step={start} attempt={attempt} t={time.time():.3f}", flush=True)

rows = 8 // px.world_size()
for step in range(start, steps):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g, dtype=torch.float64), \
        torch.randn(8, 4, generator=g, dtype=torch.float64)
    lo = px.rank() * rows
    F.mse_loss(model(x[lo:lo + rows]), y[lo:lo + rows]).backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)  # room for a kill to land anywhere in the loop
    if die_in_save == step + 1 and attempt == 0 and px.rank() == 1:
        import phalanx.checkpoint.saving as saving

        saving.write_tensors = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    px.save(os.path.join(ckpt_dir, f"step{step + 1:05d}"), model=model, optimizer=opt,
            step=step + 1, keep_last=2)
px.export(out, model)
px.shutdown()
