"""Data for data parallelism: sampler, loader, gathering and exact evaluation, batch inference."""


def _todo(*_a, **_k):
    raise NotImplementedError("phalanx.data is not written yet")


DistributedSampler = data_loader = gather = gather_for_metrics = map_batches = global_mean = _todo
