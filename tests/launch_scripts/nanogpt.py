"""A training script shaped like nanoGPT's train.py (karpathy/nanoGPT), ported the way its users
port it: `px.init()` for `init_process_group`, `px.prepare` for the DDP wrap, and nothing else
changed. Evaluation and checkpointing stay inside `if master_process:`, the model may be
compiled before it is wrapped, accumulation uses `model.require_backward_grad_sync`, clipping
`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`, and the checkpoint is nanoGPT's
`torch.save` of `raw_model.state_dict()` and `optimizer.state_dict()`.

    phalanx run -n 2 nanogpt.py key=value ...     (or plain python for one process)

Keys (nanoGPT's configurator style): strategy (ddp, zero1, zero2, zero3, or torchddp for torch's
own DistributedDataParallel), compile (none, eager, aot_eager), max_iters, eval_interval,
eval_iters, out_dir, init_from (scratch or resume), dtype (float64 or float32), generate (tokens
rank 0 generates after each evaluation), result (a path: the final weights, a torch file).

Data is made from a generator seeded by (iteration, global micro-step), so a run on N ranks
with gradient_accumulation_steps A sees the samples that one process sees with A: the global
micro-step g = micro_step * N + rank, as nanoGPT divides A by the world size.
"""

import os
import sys
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import phalanx as px

# -- config ----------------------------------------------------------------------------------
strategy, compile_backend = "ddp", "none"
max_iters, eval_interval, eval_iters, generate = 6, 3, 2, 0
out_dir, init_from, result, dtype = "out", "scratch", "", "float64"
gradient_accumulation_steps, batch_size, block_size = 4, 2, 16
learning_rate, weight_decay, beta1, beta2, grad_clip = 6e-3, 0.1, 0.9, 0.95, 1.0
n_layer, n_head, n_embd, vocab_size = 2, 2, 32, 64
for arg in sys.argv[1:]:
    key, value = arg.split("=", 1)
    old = globals()[key]
    globals()[key] = type(old)(value) if not isinstance(old, str) else value


# -- the model (nanoGPT's shape: tied embeddings, pre-norm blocks, causal attention) -----------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):  # no KV cache: the whole context every time
            logits, _ = self(idx[:, -block_size:])
            idx = torch.cat((idx, logits[:, -1, :].argmax(dim=-1, keepdim=True)), dim=1)
        return idx


# -- setup, as nanoGPT's (init_process_group -> px.init) ----------------------------------------
px.init()
ddp_rank, ddp_world_size = px.rank(), px.world_size()
master_process = ddp_rank == 0
assert gradient_accumulation_steps % ddp_world_size == 0
gradient_accumulation_steps //= ddp_world_size
torch.set_default_dtype(getattr(torch, dtype))
os.makedirs(out_dir, exist_ok=True)


def get_batch(split, it, micro_step):
    g = torch.Generator().manual_seed(zlib.crc32(
        repr((split, it, micro_step * ddp_world_size + ddp_rank)).encode()))
    data = torch.randint(0, vocab_size, (batch_size, block_size + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


iter_num = 0
torch.manual_seed(1337)
model = GPT()
checkpoint = None
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu",
                            weights_only=False)
    state_dict = checkpoint["model"]
    for k in list(state_dict):  # as nanoGPT: a compiled model's keys carry this prefix
        if k.startswith("_orig_mod."):
            state_dict[k[len("_orig_mod."):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num = checkpoint["iter_num"]
optimizer = model.configure_optimizers()
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None
if compile_backend != "none":
    model = torch.compile(model, backend=compile_backend)
if strategy == "torchddp":
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(model) if ddp_world_size > 1 else model
    raw_model = model.module if ddp_world_size > 1 else model
else:  # the one line a port changes: the wrap
    model, optimizer = px.prepare(model, optimizer, strategy=strategy)
    raw_model = px.unwrap(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, 10_000 + k, 0)
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


while True:
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.6f}, val loss {losses['val']:.6f}",
              flush=True)
        if generate:
            tokens = raw_model.generate(torch.zeros(1, 1, dtype=torch.long), generate)
            print("sample:", tokens[0].tolist(), flush=True)
        if iter_num > 0:
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                          "iter_num": iter_num}
            torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
            print(f"saving checkpoint to {out_dir}", flush=True)
    if iter_num >= max_iters:
        break
    for micro_step in range(gradient_accumulation_steps):
        if ddp_world_size > 1:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        X, Y = get_batch("train", iter_num, micro_step)
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.6f}, "
              f"norm {float(norm):.6f}", flush=True)
    iter_num += 1

if result and master_process:
    torch.save({k: v.detach().clone() for k, v in raw_model.state_dict().items()}, result)
px.shutdown()
