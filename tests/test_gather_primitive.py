"""The gather NCCL takes, run on gloo: float64 parity with one process when every unshard is an
in-place `all_gather_into_tensor` (`all_gather_single` in torch 2.13).

On gloo a `Comm` gathers shards by one broadcast per owner (collectives.py: faster there), so
the path every NCCL run takes (the all-gather primitive, its output the unit's flat buffer and
its input this rank's slice of that same buffer) would otherwise run only on a GPU. A `Comm`
made with `prefer="all_gather"` and given to `px.prepare(comm=...)` takes it on gloo too (zero3's
gathers on their own group inherit the choice, `Comm.apart`); with `"reduce_scatter"` as well,
gradients are reduced as on NCCL too. Each rank counts, through a spy on the primitive, that
every `all_gather_into` of the run went through it, in place, so the test fails if the
preference stopped reaching the engine, besides failing on any wrong value.
"""

import pytest
from test_parity64 import DTYPE, assert_close, assert_state_dicts_equal, reference, train_on_rank

from phalanx.comm import collectives
from phalanx.comm.collectives import Comm
from phalanx.testing import run_ranks
from phalanx.world import runtime

WORLD = 2
# (model, optimizer, accumulation micro-steps, clip): a frozen and an unused layer (mlp), an
# embedding and an encoder layer (transformer), parameters some ranks never touch (branchy)
COMBOS = [("mlp", "adamw", 2, True), ("transformer", "sgd", 1, False),
          ("branchy", "adamw", 1, True)]


def _spy_on_gathers() -> dict:
    """Count each sharded `Comm.all_gather_into`, and the calls of the all-gather primitive
    made inside one (in place: the input inside the output's memory)."""
    counts = {"gathers": 0, "primitive": 0, "in_place": 0}
    real_gather_into, real_primitive = Comm.all_gather_into, collectives._all_gather
    inside = []

    def gather_into(self, output, shard, *args, **kwargs):
        if self.group is not None:
            counts["gathers"] += 1
        inside.append(True)
        try:
            return real_gather_into(self, output, shard, *args, **kwargs)
        finally:
            inside.pop()

    def primitive(output, shard, **kwargs):
        if inside:
            counts["primitive"] += 1
            offset = shard.data_ptr() - output.data_ptr()
            counts["in_place"] += 0 <= offset < output.numel() * output.element_size()
        return real_primitive(output, shard, **kwargs)

    Comm.all_gather_into = gather_into  # this rank's process only: it ends with the test
    collectives._all_gather = primitive
    return counts


def _train_all(strategy, prefer):
    counts = _spy_on_gathers()
    results = {(name, opt, accum, clip): train_on_rank(
        name, opt, WORLD, accum, clip, strategy, comm=Comm(runtime.default_group(), prefer=prefer))
        for name, opt, accum, clip in COMBOS}
    return results, counts


@pytest.mark.parametrize("prefer", [("all_gather",), ("all_gather", "reduce_scatter")],
                         ids=["all_gather", "nccl_primitives"])
@pytest.mark.parametrize("strategy", [pytest.param("zero1", marks=pytest.mark.slow),
                                      pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_float64_parity_when_shards_are_gathered_by_all_gather(strategy, prefer):
    runs = run_ranks(_train_all, WORLD, args=(strategy, prefer), timeout=240)
    for combo in COMBOS:
        want_params, want_state = reference(combo[0], combo[1], WORLD, combo[2], combo[3])
        for rank, (results, _) in enumerate(runs):
            params, state = results[combo]
            context = f"{strategy} {prefer} {combo} rank {rank}"
            assert len(params) == len(want_params), context
            for i, (a, b) in enumerate(zip(params, want_params)):
                assert a.dtype == DTYPE, f"{context}: parameter {i} is {a.dtype}"
                assert_close(a, b, f"{context}: parameter {i}")
            assert_state_dicts_equal(state, want_state, context)
    for rank, (_, counts) in enumerate(runs):
        # every gather of shards took the primitive, in place, and there were gathers
        assert counts["gathers"] > 0, f"rank {rank}: no sharded gather at all"
        assert counts["primitive"] == counts["in_place"] == counts["gathers"], (
            f"rank {rank}: {counts}")
