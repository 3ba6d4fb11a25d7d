"""px.map_batches with uneven item costs: the dynamic schedule against the static split.

    .venv/bin/python benchmarks/map_batches.py            # 2 ranks, CPU, gloo

Items stand for generation requests of uneven length: `--items` items in batches of
`--batch`; the first quarter cost `--heavy` ms each, the rest `--light` ms (spent in
time.sleep, so that the two ranks on this 2-core machine do not compete for cores and the
schedule alone is measured). A second case has items that cost nothing, to show what the
dynamic schedule's store round trip costs per batch. Each schedule runs `--repeat` times,
interleaved; wall time of the slowest rank, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

import phalanx as px


def bench_rank(items, batch, heavy_ms, light_ms, repeat):
    def uneven(batch_items):
        time.sleep(sum(heavy_ms if i < items // 4 else light_ms for i in batch_items) / 1e3)
        return batch_items

    def free(batch_items):
        return batch_items

    cases = {"uneven": uneven, "free": free}
    times = {(c, s): [] for c in cases for s in ("static", "dynamic")}
    for r in range(repeat):
        for case, fn in cases.items():
            for schedule in (("static", "dynamic") if r % 2 == 0 else ("dynamic", "static")):
                dist.barrier()
                start = time.perf_counter()
                out = px.map_batches(fn, list(range(items)), batch, schedule=schedule)
                elapsed = time.perf_counter() - start
                assert out == list(range(items))
                slowest = [0.0] * px.world_size()
                dist.all_gather_object(slowest, elapsed)
                times[(case, schedule)].append(max(slowest))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--items", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heavy", type=float, default=20.0, help="ms per heavy item")
    parser.add_argument("--light", type=float, default=2.0, help="ms per light item")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    # px.spawn: a TCP rendezvous store, as under `phalanx run` (the test harness uses a file)
    t = px.spawn(bench_rank, args.items, args.batch, args.heavy, args.light, args.repeat,
                 processes=args.ranks, timeout=1800)
    print(f"{args.ranks} ranks, CPU, gloo; {args.items} items in batches of {args.batch}; "
          f"first quarter {args.heavy:g} ms per item, the rest {args.light:g} ms; "
          f"medians of {args.repeat}")
    print(f"{'items':10s} {'static s':>9s} {'dynamic s':>10s} {'dynamic / static':>17s}")
    for case in ("uneven", "free"):
        s, d = t[(case, "static")], t[(case, "dynamic")]
        print(f"{case:10s} {s:9.3f} {d:10.3f} {d / s:17.3f}")
    batches = -(-args.items // args.batch)
    extra = (t[("free", "dynamic")] - t[("free", "static")]) / batches * 1e3
    print(f"store round trip: {extra:.3f} ms per batch ({batches} batches)")


if __name__ == "__main__":
    main()
