"""Resuming as users' scripts resume, on 2 ranks in float64, against the uninterrupted run:
Accelerate's checkpointing loop, which finds its epoch from `len(loader)`, and the docs' epoch
loop with dropout, saved anywhere in an epoch (tests/resume_loops.py holds the loops)."""

import torch
from resume_loops import EPOCHS, PER_RANK, SAMPLES, accelerate_loop, epoch_loop

from phalanx.testing import run_ranks

STEPS_PER_EPOCH = SAMPLES // (2 * PER_RANK)  # 10


def _assert_equal(got, want):
    for part, ref in zip(got, want):
        assert part.keys() == ref.keys()
        for name in ref:
            value = part[name]
            if isinstance(value, dict):
                for key in ref[name]:
                    assert torch.equal(value[key], ref[name][key]), (name, key)
            else:
                assert torch.equal(value, ref[name]), name


def test_an_accelerate_style_resume_finds_its_epoch_from_len_loader(tmp_path):
    """`starting_epoch = resume_step // len(train_dataloader)`: with `len(loader)` the batches
    left (4 after step 6, 5 after step 15) it started in the wrong epoch, and from step 15 it
    trained nothing and ended as if it had finished."""
    directory = str(tmp_path)
    whole = run_ranks(accelerate_loop, 2, args=(directory, None), timeout=120)
    assert whole[0][:2] == (EPOCHS * STEPS_PER_EPOCH, [0, 1])
    for done, epoch, taken in ((6, 0, 6), (15, 1, 5)):  # steps done: in all, in the epoch
        resume_from = f"step_{done}"
        resumed = run_ranks(accelerate_loop, 2, args=(directory, resume_from), timeout=120)
        for got, want in zip(resumed, whole):
            steps, epochs, lengths, state = got
            # len(): the whole epoch's, per rank, as for a torch DataLoader and sampler
            assert lengths == (STEPS_PER_EPOCH, STEPS_PER_EPOCH - taken, SAMPLES // 2,
                               (STEPS_PER_EPOCH - taken) * PER_RANK), resume_from
            assert epochs == list(range(epoch, EPOCHS)) and steps == want[0] - done, resume_from
            _assert_equal(state, want[3])


DROPOUT_LAYOUTS = [("ddp", "px"), ("zero1", "px"), ("zero2", "px"), ("zero3", "px"),
                   ("ddp", "torch"), ("zero3", "workers"), ("ddp", "augment"),
                   ("zero3", "augment")]


def test_a_resume_with_dropout_is_exact_wherever_the_save_fell(tmp_path):
    """Saved mid-epoch (steps 5 and 13 of 10 per epoch) or at an epoch's end (10), resumed in
    a fresh job: equal to the uninterrupted run, dropout masks included, under every strategy,
    with a loader worker, and with a plain torch DataLoader over px.DistributedSampler. Before, the
    loader's iterator made after px.load drew once from the generator the load had restored, and the
    mid-epoch resumes ended 0.88 and 0.47 from the uninterrupted run (sampler.py's [Note: a pass
    continued]). With random augmentation in 2 loader workers the mid-epoch resumes ended
    3.3e-3 off: a worker's draws depended on which samples it had made before (data/seeding.py's
    [Note: a sample's own generators])."""
    directory, save_at = str(tmp_path), [5, 10, 13]
    whole = run_ranks(epoch_loop, 2, args=(directory, DROPOUT_LAYOUTS, save_at, False),
                      timeout=240)
    resumed = run_ranks(epoch_loop, 2, args=(directory, DROPOUT_LAYOUTS, save_at, True),
                        timeout=240)
    for got, want in zip(resumed, whole):
        for strategy, kind in DROPOUT_LAYOUTS:
            for at in save_at:
                _assert_equal(got[strategy, kind, at], want[strategy, kind, None])
