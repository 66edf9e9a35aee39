"""Two (or more) gloo ranks spawned for a test module: each runs worker(rank, world, init_file, out_dir) and pickles
its results to out_dir/rank<r>.pkl; a run past the deadline is killed and the test failed (a deadlock fails
instead of hanging the suite)."""
from __future__ import annotations

import pickle
import time

import pytest

SPAWN_DEADLINE_S = 60


def spawn_ranks(worker, tmp, world: int = 2, deadline_s: float = SPAWN_DEADLINE_S) -> list:
    """[rank 0's results, rank 1's, ...] of `worker` spawned on `world` processes, files under the folder tmp."""
    import torch.multiprocessing as mp
    ctx = mp.start_processes(worker, args=(world, str(tmp / "init"), str(tmp)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"gloo ranks still running after {deadline_s} s: a deadlock")
    results = []
    for r in range(world):
        with open(tmp / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
