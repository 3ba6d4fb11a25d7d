"""global_mean makes a variable-length language model's gradient independent of how the global
batch is split over ranks and accumulation micro-steps; a per-rank mean does not.

Reference: one process, the whole global batch of each step at once, loss = mean over ALL its
tokens. Distributed: 3 ranks (px.prepare ddp), 2 accumulation micro-steps (px.no_sync).
"""

import contextlib

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import run_ranks

VOCAB, WIDTH = 13, 16
WORLD, ACCUMULATION, BATCH, STEPS = 3, 2, 2, 3
GLOBAL = WORLD * ACCUMULATION * BATCH  # sequences per optimizer step


def _sequences():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(2, 24, (GLOBAL * STEPS,), generator=g)
    return [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]


def _pad(sequences):
    """Next-token batch: inputs padded with 0, targets padded with -100 (ignored)."""
    longest = max(len(s) for s in sequences) - 1
    x = torch.zeros(len(sequences), longest, dtype=torch.long)
    y = torch.full((len(sequences), longest), -100, dtype=torch.long)
    for i, s in enumerate(sequences):
        x[i, :len(s) - 1], y[i, :len(s) - 1] = s[:-1], s[1:]
    return x, y


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.rnn = torch.nn.GRU(WIDTH, WIDTH, batch_first=True)  # causal: padding is harmless
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0])


def _token_loss_sum(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum", ignore_index=-100)


def _new_model():
    torch.manual_seed(0)
    model = TinyLM()
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _reference():
    model, opt = _new_model()
    data = _sequences()
    for step in range(STEPS):
        x, y = _pad(data[step * GLOBAL:(step + 1) * GLOBAL])
        (_token_loss_sum(model, x, y) / (y != -100).sum()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _ranks_train(normalisation):
    model, opt = _new_model()
    model, opt = px.prepare(model, opt, strategy="ddp")
    loader = px.data_loader(_sequences(), BATCH, shuffle=False, collate_fn=_pad)
    batches = iter(loader)
    for _ in range(STEPS):
        micro = [next(batches) for _ in range(ACCUMULATION)]
        count = torch.tensor(sum(int((y != -100).sum()) for _, y in micro))
        for i, (x, y) in enumerate(micro):
            last = i == ACCUMULATION - 1
            with contextlib.nullcontext() if last else px.no_sync(model):
                if normalisation == "global_mean":
                    loss = px.global_mean(_token_loss_sum(model, x, y), count)
                else:  # the usual per-rank mean, divided by the accumulation steps
                    loss = _token_loss_sum(model, x, y) / (y != -100).sum() / ACCUMULATION
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in px.unwrap(model).state_dict().items()}


def _relative_update_error(params, reference, start):
    """Largest ||p - p_ref|| / ||p_ref - p_0|| over tensors: the error relative to the update."""
    return max(float((params[k] - reference[k]).norm() / (reference[k] - start[k]).norm())
               for k in reference)


def test_global_mean_matches_one_process_and_a_per_rank_mean_does_not():
    reference = _reference()
    start = {k: v.clone() for k, v in _new_model()[0].state_dict().items()}
    exact = run_ranks(_ranks_train, WORLD, args=("global_mean",), timeout=120)
    naive = run_ranks(_ranks_train, WORLD, args=("per_rank_mean",), timeout=120)
    for params in exact:
        assert _relative_update_error(params, reference, start) < 1e-5
        for k in reference:  # and the parameters themselves, relative to their size
            assert float((params[k] - reference[k]).norm() / reference[k].norm()) < 1e-5
    assert _relative_update_error(naive[0], reference, start) > 1e-3


def _ranks_count_once():
    calls = []
    original = torch.distributed.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        count = torch.tensor(float(px.rank() + 1))
        loss = torch.tensor(6.0, requires_grad=True)
        values = [px.global_mean(loss, count).item() for _ in range(3)]  # one step, 3 micro-steps
        reduced_once = len(calls)
        count += 1  # changed in place: reduced again
        values.append(px.global_mean(loss, count).item())
        values.append(px.global_mean(loss, 0).item())  # no elements anywhere: zero, not NaN
    finally:
        torch.distributed.all_reduce = original
    return values, reduced_once, len(calls)


def test_global_mean_reduces_the_count_once_per_step():
    results = run_ranks(_ranks_count_once, 3, timeout=60)
    for values, reduced_once, reduced in results:
        assert values == [6.0 * 3 / 6] * 3 + [6.0 * 3 / 9, 0.0]
        assert (reduced_once, reduced) == (1, 3)
