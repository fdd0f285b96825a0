"""``Store.write_shard`` of one shard shape, interleaved between source trees and settings (CPU).

Each round runs every variant once, in a new random order, each in a fresh process that writes the
same shard ``--writes`` times (after one untimed write) and reports the median wall and CPU time;
the table gives per variant the median over rounds, its range, and the paired ratio to the first
variant (its time / this variant's time, per round; > 1: this one is faster). A variant is
``name=TREE[:ENV=VALUE,...]``: a source tree (this checkout, or an older one exported with ``git
archive``; its ``tracestore`` must be importable with ``PYTHONPATH`` given as an ``ENV``) and the
environment it runs with (e.g. ``TRACESTORE_SHARD_FILES=1``). Shapes: ``TRAJxTOKENS`` trajectories
of that many tokens in 512-token chunks of bench_storage's 20-site NVFP4 records (7,680 B/token);
``--where memory`` publishes to ``memory://`` (the path object stores take), ``file`` to a local
directory with fsync.

Example (this machine's numbers are in the commit that set ``SPLIT_MIN_BYTES``)::

    python bench/ab_write_shard.py --shape 8x512 --where memory --rounds 10 \\
        old=/tmp/t_old:PYTHONPATH=/tmp/oldpkg new1=.:TRACESTORE_SHARD_FILES=1 new2=.:TRACESTORE_SHARD_SPLIT_MIB=8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


def child(tree: str, n_traj: int, n_tok: int, writes: int, where: str) -> None:
    sys.path.insert(0, os.path.join(tree, "bench"))
    from bench_storage import SPEC, make_step

    from tracestore.storage.store import Store

    chunks = make_step(n_traj, n_tok, 512, False)
    url = f"memory://ab-{os.getpid()}" if where == "memory" else "file://" + tempfile.mkdtemp()
    st = Store(url)
    st.put_run(SPEC)
    times = []
    for i in range(writes + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        st.write_shard(SPEC.run, 0, "w0", i, chunks)
        if i:
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    import tracestore

    print(json.dumps({"module": tracestore.__file__, "times": times}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", help="name=TREE[:ENV=VALUE,...]")
    ap.add_argument("--shape", default="8x512")
    ap.add_argument("--where", choices=("memory", "file"), default="memory")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--writes", type=int, default=9)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        tree, n_traj, n_tok, writes, where = a.child
        return child(tree, int(n_traj), int(n_tok), int(writes), where)
    if not a.variants:
        ap.error("give at least one variant: name=TREE[:ENV=VALUE,...]")
    n_traj, n_tok = (int(v) for v in a.shape.split("x"))
    variants = {}
    for v in a.variants:
        name, _, rest = v.partition("=")
        tree, _, envs = rest.partition(":")
        env = dict(e.split("=", 1) for e in envs.split(",") if e)
        variants[name] = (os.path.abspath(tree), env)
    res: dict[str, list[tuple[float, float]]] = {n: [] for n in variants}
    modules: dict[str, str] = {}
    for r in range(a.rounds):
        order = list(variants)
        random.Random(r).shuffle(order)
        for name in order:
            tree, env = variants[name]
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                tree,
                str(n_traj),
                str(n_tok),
                str(a.writes),
                a.where,
            ]
            out = subprocess.run(cmd, env={**os.environ, **env}, cwd=tree, capture_output=True, text=True, check=True)
            d = json.loads(out.stdout.strip().splitlines()[-1])
            modules[name] = d["module"]
            res[name].append((statistics.median(t for t, _ in d["times"]), statistics.median(c for _, c in d["times"])))
    mib = n_traj * n_tok * 7680 / (1 << 20)
    print(
        f"# write_shard {a.shape} ({mib:.0f} MiB) on {a.where}, {a.rounds} rounds x {a.writes} writes, "
        f"{os.cpu_count()} cores"
    )
    first = next(iter(variants))
    for name, xs in res.items():
        w = [t for t, _ in xs]
        ratios = sorted(f / t for (f, _), t in zip(res[first], w, strict=True))
        print(
            f"{name:12s} {1e3 * statistics.median(w):7.1f} ms [{1e3 * min(w):.1f}-{1e3 * max(w):.1f}]"
            f"  cpu {1e3 * statistics.median(c for _, c in xs):6.1f} ms"
            f"  {first}/this {statistics.median(ratios):.3f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]  ({modules[name]})"
        )


if __name__ == "__main__":
    main()
