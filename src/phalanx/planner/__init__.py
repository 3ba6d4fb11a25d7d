"""`phalanx plan`: memory and time planner."""


def plan(*_a, **_k):
    raise NotImplementedError("phalanx.planner is not written yet")
