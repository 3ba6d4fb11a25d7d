"""Parameter memory per rank of a PEFT LoRA Llama under zero3, beside FSDP2 on the same model.

    .venv/bin/python benchmarks/lora_memory.py              # 2 ranks, CPU, gloo, fp32 and bf16
    .venv/bin/python benchmarks/lora_memory.py --precisions bf16 --world 3

Needs transformers and peft (pip install transformers peft). The model: a Llama of 4 blocks
(hidden 512, intermediate 1536, 8 heads, vocabulary 32000, head not tied: 46.4M parameters,
177.3 MiB in fp32) with PEFT LoRA adapters of rank 8 on q_proj and v_proj (65,536 trainable
parameters), built whole on every rank from one seed, AdamW over the adapters, 2 training
steps on 2 rows of 64 tokens per rank. phalanx: `px.prepare(model, opt, strategy="zero3",
precision=...)`. FSDP2: `fully_shard` on each decoder layer, then on the model (PyTorch's
recipe; it shards frozen parameters too), bf16 with `MixedPrecisionPolicy(param_dtype=bf16)`.
Each configuration runs in processes of its own.

Measured per rank, as bytes of distinct storages (no resident-set noise):
  at rest   after prepare (fully_shard) and again after the steps: every storage that holds a
            parameter's values, its shard or its full copy (phalanx: masters, frozen shards and
            the full buffers allocated now; FSDP2: the sharded parameters' local tensors and
            every parameter registered in a module now)
  peak      the largest of the same, sampled before and after every module's forward and at
            every module output's gradient in backward (phalanx also reports its own count
            of the full buffers gathered at once, `gatherer.peak_bytes`, beside it)
  1/N       the model's bytes (fp32) / N, what a rank holds at rest when every parameter is
            sharded in fp32
  root      the largest root gathered whole (phalanx; FSDP2 the same groups in its dtype): here
            the one holding the embedding, the final norm and the head (70% of this model),
            which spans the whole forward and is kept from forward through backward; `block`
            is a decoder layer's
What FSDP2 holds in its all-gather buffers between a gather and the copy into its unsharded
parameters is not seen by the sampling, so the comparison leans in FSDP2's favour (a block
prefetched ahead is counted for phalanx, not for FSDP2). `--prefetch 0` passes that option to
px.prepare (gather each block when it computes).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import phalanx as px
from phalanx.testing import engine_of, run_ranks

MB = 2**20
ROWS, TOKENS, STEPS = 2, 64, 2
OPTIONS: dict = {}  # --prefetch: passed to px.prepare (set before the ranks are forked)


LLAMA = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8)


def lora_llama(lora: bool = True, **sizes):
    """The Llama above, from seed 0, with LoRA adapters (or bare, every parameter trainable).

    `sizes` overrides LLAMA's fields: benchmarks/lora_steps.py checks its parity on a tiny one.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA, **sizes}, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if not lora:
        return model
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


class ParamBytes:
    """Samples the bytes of every storage holding parameter values (see the docstring)."""

    def __init__(self, model, held):
        self.model, self.held, self.peak = model, list(held), 0
        for module in model.modules():
            module.register_forward_pre_hook(lambda *a: self.sample())
            module.register_forward_hook(lambda m, a, out: self.watch(out))

    def now(self) -> int:
        return sum({**_storages(self.held),
                    **_storages(p for m in self.model.modules()
                                for p in m._parameters.values())}.values())

    def sample(self, *_):
        self.peak = max(self.peak, self.now())

    def watch(self, out):
        self.sample()
        tensors = [out] if torch.is_tensor(out) else [t for t in getattr(out, "values", list)()
                                                      if torch.is_tensor(t)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self.sample)


def measure(config: str, precision: str):
    model = lora_llama()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    def adamw():
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    if config == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" \
            else MixedPrecisionPolicy()
        layers = model.base_model.model.model.layers
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = adamw()  # after fully_shard, which replaces the parameters by its own
        held = list(model.parameters())  # DTensors: their local shards
        itemsize = 2 if precision == "bf16" else 4
        block = max(sum(p.numel() for p in layer.parameters()) for layer in layers) * itemsize
        root = sum(p.numel() for n, p in model.named_parameters()
                   if ".layers." not in n) * itemsize
        wrapped = model
    else:
        wrapped, optimizer = px.prepare(model, adamw(), strategy="zero3", precision=precision,
                                        **OPTIONS)
        engine = engine_of(wrapped)
        held = [t for u in engine.all_units for t in u.held()]
        sizes = [(r.name, sum(u.full_bytes for u in r.units)) for r in engine.gatherer.roots]
        block = max(size for name, size in sizes if ".layers." in name)
        root = max(size for name, size in sizes if ".layers." not in name)
    sampler = ParamBytes(model, held)
    at_rest = sampler.now()
    g = torch.Generator().manual_seed(px.rank())
    for _ in range(STEPS):
        tokens = torch.randint(0, 32000, (ROWS, TOKENS), generator=g)
        wrapped(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"model": model_bytes, "1/N": model_bytes / px.world_size(), "at rest": at_rest,
           "after steps": sampler.now(), "peak": sampler.peak, "root": root, "block": block}
    if config != "FSDP2":
        out["gathered peak"] = engine.gatherer.peak_bytes + at_rest
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--prefetch", type=int, default=None, help="px.prepare's prefetch")
    args = parser.parse_args()
    if args.prefetch is not None:
        OPTIONS["prefetch"] = args.prefetch
    print(f"{'config':<8} {'prec':<5} {'model':>7} {'1/N':>7} {'at rest':>8} {'after':>8} "
          f"{'peak':>8} {'root':>7} {'block':>7}  (MiB per rank, the largest over "
          f"{args.world} ranks)")
    for precision in args.precisions.split(","):
        for config in ("zero3", "FSDP2"):
            ranks = run_ranks(measure, args.world, args=(config, precision), timeout=900)
            worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
            line = (f"{config:<8} {precision:<5} {worst['model'] / MB:7.1f} "
                    f"{worst['1/N'] / MB:7.1f} {worst['at rest'] / MB:8.1f} "
                    f"{worst['after steps'] / MB:8.1f} {worst['peak'] / MB:8.1f} "
                    f"{worst['root'] / MB:7.1f} {worst['block'] / MB:7.1f}")
            if "gathered peak" in worst:
                line += f"  (its own count of the peak: {worst['gathered peak'] / MB:.1f})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
