"""Gloo ranks spawned for a test module: each process joins a gloo group (a collective no rank joins fails after
gloo_timeout_s, never hangs), runs scenarios(rank, world) and pickles what it returns; a run past the deadline is
killed and the test failed (a deadlock fails instead of hanging the suite)."""
from __future__ import annotations

import datetime
import pickle
import time

import pytest

SPAWN_DEADLINE_S = 60


def _rank_main(rank, world, init_file, out_dir, scenarios, gloo_timeout_s):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=gloo_timeout_s))
    try:
        res = scenarios(rank, world)
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(res, f)


def spawn_ranks(scenarios, tmp, world: int = 2, deadline_s: float = SPAWN_DEADLINE_S,
                gloo_timeout_s: float = 5) -> list:
    """[rank 0's scenarios(0, world), rank 1's, ...], each run in its own process (scenarios: a module-level
    function of the test module), files under the folder tmp."""
    import torch.multiprocessing as mp
    ctx = mp.start_processes(_rank_main, args=(world, str(tmp / "init"), str(tmp), scenarios, gloo_timeout_s),
                             nprocs=world, join=False, start_method="spawn")
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


def ranks_fixture(scenarios, world: int = 2, gloo_timeout_s: float = 5, deadline_s: float = SPAWN_DEADLINE_S):
    """A module-scoped pytest fixture: each rank's results from one spawn_ranks(scenarios) (assign it to the
    fixture's name in the test module: `gloo2 = ranks_fixture(_scenarios)`)."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        return spawn_ranks(scenarios, tmp_path_factory.mktemp(f"gloo{world}"), world, deadline_s, gloo_timeout_s)
    return fixture


def one_rank_fixture(gloo_timeout_s: float = 5):
    """A module-scoped pytest fixture: this process as a one-rank gloo group while the module's tests run."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        import torch.distributed as dist
        assert not dist.is_initialized(), "another test left a process group behind"
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('gloo1') / 'init'}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=gloo_timeout_s))
        try:
            yield
        finally:
            dist.destroy_process_group()
    return fixture


def outcome(fn):
    """("ok", fn()) or (the exception's type name, its message): picklable, asserted on in the parent."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - recorded, asserted on in the parent
        return (type(e).__name__, str(e))
