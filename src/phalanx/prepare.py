"""px.prepare: wrap a model and its optimizer for a data-parallel strategy."""


def _todo(*_a, **_k):
    raise NotImplementedError


prepare = unwrap = no_sync = clip_grad_norm_ = _todo
