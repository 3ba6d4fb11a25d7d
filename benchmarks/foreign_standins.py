"""Stand-ins for what Accelerate's checkpointing example downloads (benchmarks/foreign_scripts.py).

The example tokenizes GLUE MRPC with bert-base-cased's tokenizer, fine-tunes bert-base-cased
and scores it with `evaluate`'s GLUE metric; none of that can be fetched here. These stand-ins
keep the calls the example makes (`load_dataset(...)`, `.map`, `.rename_column`, the
tokenizer's `__call__` and `pad`, `from_pretrained`, `metric.add_batch`/`compute`,
`get_linear_schedule_with_warmup`) on synthetic sentence pairs, a small classifier and
accuracy/F1, so the example's own code runs unchanged around them. The file is copied beside
the example as `_standins.py`; the original and the converted copy import the same one.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

VOCAB = 64
TRAIN, VALIDATION = 256, 70  # 70: the last evaluation batch is short on 2 ranks


def _pairs(count: int, seed: int) -> dict:
    """Sentence pairs of 'words' w0..w63; the label: most of the pair's words are w0..w31."""
    g = torch.Generator().manual_seed(seed)
    rows = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(count):
        n1, n2 = (int(v) for v in torch.randint(4, 12, (2,), generator=g))
        a = torch.randint(0, VOCAB, (n1,), generator=g).tolist()
        b = torch.randint(0, VOCAB, (n2,), generator=g).tolist()
        rows["sentence1"].append(" ".join(f"w{t}" for t in a))
        rows["sentence2"].append(" ".join(f"w{t}" for t in b))
        rows["label"].append(int(2 * sum(t < VOCAB // 2 for t in a + b) > len(a) + len(b)))
        rows["idx"].append(i)
    return rows


class Split:
    """A column table, indexable by row (as a `datasets.Dataset` is for a DataLoader)."""

    def __init__(self, columns: dict):
        self.columns = columns

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.columns.items()}

    def map(self, fn, batched=True, remove_columns=()):
        added = fn(self.columns)
        kept = {k: v for k, v in self.columns.items() if k not in remove_columns}
        return Split({**kept, **added})

    def rename_column(self, old, new):
        return Split({(new if k == old else k): v for k, v in self.columns.items()})


class Splits(dict):
    def map(self, fn, **kw):
        return Splits({k: v.map(fn, **kw) for k, v in self.items()})

    def rename_column(self, old, new):
        return Splits({k: v.rename_column(old, new) for k, v in self.items()})


def load_dataset(*_names):
    return Splits(train=Split(_pairs(TRAIN, 1)), validation=Split(_pairs(VALIDATION, 2)))


class BatchEncoding(dict):
    def to(self, device):
        for k, v in self.items():
            self[k] = v.to(device)
        return self


class AutoTokenizer:
    """Words to ids: [CLS]=1, [SEP]=2, wN = N + 3; pads with 0."""

    @staticmethod
    def from_pretrained(_name):
        return AutoTokenizer()

    def __call__(self, first, second, truncation=True, max_length=None):
        ids = [[1, *(int(w[1:]) + 3 for w in a.split()), 2, *(int(w[1:]) + 3 for w in b.split()), 2]
               for a, b in zip(first, second)]
        return {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}

    def pad(self, examples, padding="longest", max_length=None, pad_to_multiple_of=None,
            return_tensors="pt"):
        length = max_length or max(len(e["input_ids"]) for e in examples)
        if pad_to_multiple_of:
            length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        out = BatchEncoding()
        for key in ("input_ids", "attention_mask"):
            out[key] = torch.tensor([e[key] + [0] * (length - len(e[key])) for e in examples])
        out["labels"] = torch.tensor([e["labels"] for e in examples])
        return out


class TinyClassifier(torch.nn.Module):
    """Embeddings averaged over the unpadded tokens, one hidden layer, two classes."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB + 3, 16)
        self.hidden = torch.nn.Linear(16, 32)
        self.classifier = torch.nn.Linear(32, 2)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.classifier(torch.tanh(self.hidden(pooled)))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return types.SimpleNamespace(loss=loss, logits=logits)


class AutoModelForSequenceClassification:
    @staticmethod
    def from_pretrained(_name, return_dict=True):
        return TinyClassifier()


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    """Linear warm-up from 0, then linear decay to 0 at num_training_steps (transformers' rule)."""
    def factor(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _Metric:
    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions, references):
        self.predictions += predictions.tolist()
        self.references += references.tolist()

    def compute(self):
        p, r = torch.tensor(self.predictions), torch.tensor(self.references)
        self.predictions, self.references = [], []
        tp = int(((p == 1) & (r == 1)).sum())
        f1 = 2 * tp / max(1, int((p == 1).sum()) + int((r == 1).sum()))
        return {"accuracy": round(float((p == r).double().mean()), 6), "f1": round(f1, 6),
                "count": len(p)}


evaluate = types.SimpleNamespace(load=lambda *_names: _Metric())
