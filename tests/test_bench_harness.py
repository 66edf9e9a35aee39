"""The benchmark harness and scripts, on a CPU: their logic (interleaving, statistics, error capture,
JSON and table output) and a dry run of each script, so the GPU runs do not fail on a typo."""
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

harness = importlib.import_module("harness")


def cpu_cfg(tmp_path, **kw):
    cfg = harness.Config(device="cpu", warmup=1, reps=4, rounds=2, modes=("wall",), out_dir=tmp_path,
                         plot=False, progress=False, quick=True, copy_bytes=1 << 20, flush_bytes=1 << 20)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_interleaving_alternates():
    assert harness.interleaved_order(["a", "b", "c"], 4) == [["a", "b", "c"], ["c", "b", "a"],
                                                              ["a", "b", "c"], ["c", "b", "a"]]


def test_summarize_and_geomean():
    s = harness.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["n"] == 5 and s["p10"] <= s["median"] <= s["p90"]
    assert harness.summarize([])["median"] is None
    assert math.isclose(harness.geomean([2.0, 8.0]), 4.0)
    assert harness.geomean([None, 0, -1]) is None


def test_measure_records_every_arm_and_keeps_going_after_an_error(tmp_path):
    calls = {"a": 0, "b": 0}

    def a():
        calls["a"] += 1

    def b():
        calls["b"] += 1
        sum(range(2000))

    def broken():
        raise RuntimeError("boom")

    timer = harness.Timer(cpu_cfg(tmp_path))
    res = timer.measure([harness.Arm("a", a), harness.Arm("b", b), harness.Arm("broken", broken)])
    assert res["a"]["wall"]["n"] == 4 and res["b"]["wall"]["n"] == 4
    assert res["a"]["wall"]["median"] > 0
    assert "boom" in res["broken"]["wall"]["error"]
    assert calls["a"] == 1 + 4 and calls["b"] == 1 + 4  # warm-up + samples


def test_union_length_counts_overlaps_once_and_skips_gaps():
    assert harness.union_length([]) == 0.0
    assert harness.union_length([(0.0, 10.0)]) == 10.0
    # two overlapping kernels (a dependent launch starting early) and one after a launch gap
    assert harness.union_length([(5.0, 30.0), (0.0, 10.0), (40.0, 45.0)]) == 35.0
    assert harness.union_length([(0.0, 10.0), (10.0, 12.0), (2.0, 3.0)]) == 12.0


def test_kernel_mode_on_cpu_is_an_error_entry(tmp_path):
    timer = harness.Timer(cpu_cfg(tmp_path, modes=("kernel", "wall")))
    res = timer.measure([harness.Arm("a", lambda: None)])
    assert "CUDA" in res["a"]["kernel"]["error"] and res["a"]["wall"]["n"] == 4


def test_kernel_mode_is_opt_in():
    assert "kernel" not in harness.MODES and "kernel" in harness.ALL_MODES
    assert "kernel" not in harness.Config(device="cpu").modes


def test_graph_mode_on_cpu_is_an_error_entry(tmp_path):
    timer = harness.Timer(cpu_cfg(tmp_path, modes=("graph", "wall")))
    res = timer.measure([harness.Arm("a", lambda: None)])
    assert "error" in res["a"]["graph"] and res["a"]["wall"]["n"] == 4


def test_run_writes_json_table_speedups(tmp_path, capsys):
    cfg = cpu_cfg(tmp_path)
    run = harness.Run("unit", cfg, baseline="slow")
    run.start(2)
    x = torch.randn(256, 256)
    for n in (1, 2):
        run.add(harness.Case(f"case{n}", {"n": n},
                             [harness.Arm("fast", lambda: x.sum()),
                              harness.Arm("slow", lambda: [x @ x for _ in range(3)])],
                             bytes=x.numel() * 4))
        partial = json.loads(run.path.read_text())   # written after every case
        assert partial["partial"] is True and len(partial["cases"]) == n
    path = run.finish()
    doc = json.loads(path.read_text())
    assert doc["partial"] is False
    assert doc["copy_ceiling"]["GBps"] > 0
    assert [c["name"] for c in doc["cases"]] == ["case1", "case2"]
    c = doc["cases"][0]
    assert c["speedup"]["fast"]["wall"] > 0
    assert c["arms"]["fast"]["bandwidth"]["wall"]["pct_copy"] > 0
    assert doc["summary"]["fast"]["wall"]["cases"] == 2
    assert doc["meta"]["torch"] == torch.__version__
    out = capsys.readouterr().out
    assert "case1" in out and "fast vs slow" in out


def test_out_json_path_is_honoured(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    harness.add_common_args(p)
    cfg = harness.config_from_args(p.parse_args(["--dry-run", "--out", str(tmp_path / "x.json")]))
    assert cfg.device == "cpu" and cfg.modes == ("wall",)
    assert cfg.out_dir == tmp_path and cfg.out_file == "x.json"


def test_two_benchmarks_given_one_out_file_keep_both(tmp_path):
    # bench_sglang's phases are one Run each: with --out x.json the second must not replace the first's file
    cfg = cpu_cfg(tmp_path, out_file="x.json")
    first, second = harness.Run("sglang_decode", cfg), harness.Run("sglang_verify", cfg)
    for run, t in ((first, 1.0), (second, 2.0)):
        run.add(harness.Case("c", {}, [harness.Arm("a", lambda t=t: t)]))
    assert first.path == tmp_path / "x.json" and second.path == tmp_path / "x_sglang_verify.json"
    assert json.loads(first.path.read_text())["benchmark"] == "sglang_decode"
    assert json.loads(second.path.read_text())["benchmark"] == "sglang_verify"


def test_torch_step_matches_reference():
    """The stand-in recurrent step of the unfused arm (used without fla) is the KDA step."""
    from flashkda_ext.reference import kda_decode_step

    g = torch.Generator().manual_seed(0)
    rows, H, HV, K, V, slots = 3, 2, 4, 8, 6, 7
    q, k = torch.randn(rows, H, K, generator=g), torch.randn(rows, H, K, generator=g)
    v = torch.randn(rows, HV, V, generator=g)
    glog = -torch.rand(rows, HV, K, generator=g)
    beta = torch.randn(rows, HV, generator=g)
    pool = torch.randn(slots, HV, V, K, generator=g, dtype=torch.float64)
    idx = torch.tensor([4, 0, 6], dtype=torch.int32)
    ref_out, ref_pool = kda_decode_step(q, k, v, glog, beta, state=pool, state_indices=idx, gate="log")
    mine = pool.clone()
    out = harness.torch_decode_step(q.double(), k.double(), v.double(), glog.double(), torch.sigmoid(beta.double()),
                                    state=mine, state_indices=idx)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine, ref_pool, rtol=1e-5, atol=1e-5)


def test_torch_gate_matches_reference():
    from flashkda_ext.reference import gate_log_decay

    g = torch.randn(3, 2, 4)
    A_log, dt_bias = torch.randn(2), torch.randn(8)
    for gate, lb in (("softplus", None), ("bounded", -5.0)):
        want = gate_log_decay(g.double(), gate, A_log=A_log.double(), dt_bias=dt_bias.double(), lower_bound=lb)
        got = harness.torch_gate(g, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lb)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _script(name):
    return importlib.import_module(name)


def test_fused_decode_dry_run(tmp_path):
    mod = _script("bench_fused_decode")
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "fused_decode.json").read_text())
    assert doc["cases"], "no cases ran"
    for c in doc["cases"]:
        assert set(c["arms"]) == {"fused", "unfused_torch", "step"}
        for arm in c["arms"].values():
            assert arm["time_us"]["wall"]["median"] > 0, arm
        # the fused op and the unfused sequence compute the same function
        assert c["notes"]["rel_l2_fused_vs_unfused"] < 2e-2
        assert c["fused_over_step"]["wall"] > 0


@pytest.mark.parametrize("extra,tokens,states,gate", [
    ([], [4], ["f32"], "softplus"),
    (["--tokens", "2,8", "--state", "f32,bf16", "--gate", "bounded"], [2, 8], ["f32", "bf16"], "bounded"),
])
def test_fused_verify_dry_run(tmp_path, extra, tokens, states, gate):
    """bench_fused_verify.py end to end on the CPU backend: every point of the grid times the three arms (the
    unfused one under its torch name), the fused op agrees with the unfused sequence, and each record has its
    fused / step ratio and the fused op's traffic."""
    mod = _script("bench_fused_verify")
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--out", str(tmp_path)] + extra) == 0
    doc = json.loads((tmp_path / "fused_verify.json").read_text())
    assert doc["baseline"] == "unfused_torch" and doc["meta"]["gate"] == gate and not doc["meta"]["fla_used"]
    points = [(c["params"]["state"], c["params"]["T"], c["params"]["rows"]) for c in doc["cases"]]
    assert points == [(s, t, n) for s in states for t in tokens for n in (1, 3)]
    for c in doc["cases"]:
        p = c["params"]
        assert set(c["arms"]) == {"fused", "unfused_torch", "step"} and p["heads"] == 2 and p["gate"] == gate
        for arm in c["arms"].values():
            assert arm["time_us"]["wall"]["median"] > 0, arm
        assert c["notes"]["rel_l2_fused_vs_unfused"] < 2e-2
        assert c["fused_over_step"]["wall"] > 0
        assert c["bytes"] == mod.traffic(p["rows"], p["T"], 2, p["head_dim"], 4 if p["state"] == "f32" else 2)[0]


@pytest.mark.parametrize("T,gate,state_dtype,longer", [
    (1, "softplus", torch.float32, 0), (2, "bounded", torch.bfloat16, 0),
    (4, "softplus", torch.bfloat16, 2), (8, "bounded", torch.float32, 1)])
def test_unfused_verify_pieces_are_the_reference(T, gate, state_dtype, longer):
    """The unfused verify sequence's torch pieces (the conv over the draft tokens with its cache, read at the
    accepted position; the gate; the verify recurrence; the gated RMSNorm), in fp32, are the reference's fused
    verify: output, conv lines (also lines longer than T + 2) and state pool."""
    import fused_common as fc
    from flashkda_ext.reference import fused_kda_verify_step

    gen = torch.Generator().manual_seed(T)
    r = lambda *shape, s=1.0: torch.randn(*shape, generator=gen) * s  # noqa: E731
    N, H, D = 3, 2, 8
    HD, C, tokens, slots = H * D, 3 * H * D, N * T, N * T + 5
    x, conv_weight, conv = r(1, tokens, C), r(C, 4, s=0.5), r(slots, C, T + 2 + longer)
    g, beta, output_gate = r(1, tokens, H, D), r(1, tokens, H), r(1, tokens, H, D)
    A_log, dt_bias, norm_weight = r(H, s=0.5), r(HD, s=0.5), 1 + r(D, s=0.1)
    state = r(slots, H, D, D, s=0.1).to(state_dtype)
    idx = torch.randperm(slots, generator=gen)[:tokens].view(N, T).to(torch.int32)
    nacc = torch.tensor([T, 1, max(1, T // 2)], dtype=torch.int32)
    cu = torch.arange(0, tokens + 1, T, dtype=torch.int32)
    gate_kw = dict(gate=gate, lower_bound=-5.0 if gate == "bounded" else None)
    want, want_conv, want_state = fused_kda_verify_step(
        x, conv_weight, conv, g, beta, A_log, dt_bias, state, output_gate, norm_weight, state_indices=idx,
        cu_seqlens=cu, num_accepted_tokens=nacc, dtype=torch.float32, **gate_kw)
    q, k, v, o, out, g_log = (torch.empty(1, tokens, H, D) for _ in range(6))
    fc.conv_split_fn(x, conv_weight, conv, idx[:, 0], (q, k, v), offsets=nacc - 1)()
    fc.gate_fn(g, A_log, dt_bias, gate_kw, g_log)()
    harness.torch_verify_step(q[0], k[0], v[0], g_log[0], torch.sigmoid(beta[0]), state=state, state_indices=idx,
                              num_accepted_tokens=nacc, out=o[0])
    fc.gated_rmsnorm_fn(output_gate, norm_weight, out)(o)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, want_conv, rtol=0, atol=0)
    torch.testing.assert_close(state.float(), want_state.float(), rtol=1e-5, atol=1e-5)


def test_fused_agreement_puts_the_touched_slots_back():
    """The fused benchmarks' agreement check runs both arms from the same pool slots and leaves the pools as
    they were; an arm that raises is recorded, not raised."""
    import fused_common as fc

    pool, lines = torch.randn(6, 2, 3), torch.randn(6, 4)
    before = (pool.clone(), lines.clone())
    idx = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)

    def arm(scale):
        def run():
            out = pool[idx.flatten().long()].sum() * scale + lines[idx[:, 0].long()].sum()
            pool.index_fill_(0, idx.flatten().long(), 7.0)
            lines[idx[:, 0].long()] += 1.0
            return out.reshape(1)
        return run

    notes = {}
    fc.agreement(arm(1.0), arm(1.0), ((pool, idx), (lines, idx[:, 0])), notes)
    assert notes == {"rel_l2_fused_vs_unfused": 0.0}
    assert torch.equal(pool, before[0]) and torch.equal(lines, before[1])
    fc.agreement(arm(1.0), lambda: 1 / 0, ((pool, idx), (lines, idx[:, 0])), notes)
    assert notes["agreement_check_error"].startswith("ZeroDivisionError")
    assert torch.equal(pool, before[0]) and torch.equal(lines, before[1])
    skipped = {}
    fc.agreement(arm(1.0), arm(2.0), ((pool, idx),), skipped, max_bytes=4 * 2 * 3 * 4)   # 4 slots of 24 bytes
    assert skipped == {} and torch.equal(pool, before[0])


def test_host_mode_times_blocks_of_calls_back_to_back(tmp_path):
    calls = []
    timer = harness.Timer(cpu_cfg(tmp_path, modes=("host",)))
    res = timer.measure([harness.Arm("a", lambda: calls.append(1))])
    assert res["a"]["host"]["n"] == 4 and res["a"]["host"]["median"] > 0
    assert len(calls) == 1 + 4 * harness.HOST_BLOCK  # warm-up + 4 samples of one block each


def test_cpu_run_keeps_host_mode_and_drops_device_modes():
    args = type("A", (), dict(device="cpu", dry_run=False, quick=True, reps=None, warmup=None, rounds=None,
                              modes="graph,host,wall", no_cold_l2=False, no_plot=True, no_progress=True, out=None))
    assert harness.config_from_args(args).modes == ("host", "wall")


def test_overhead_dry_run(tmp_path):
    mod = _script("bench_overhead")
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "host_overhead.json").read_text())
    ops = {c["params"]["op"] for c in doc["cases"]}
    assert ops == {"kda_decode", "fused_kda_decode", "kda_prefill"}
    for mode in ("wall", "host"):
        assert all("error" not in a["time_us"][mode] for c in doc["cases"] for a in c["arms"].values())
    assert all("validate_dispatch_host" in c["notes"] for c in doc["cases"])
    # the A/B reader: the same file as base and change differs by exactly nothing
    ab = _script("overhead_ab")
    path = str(tmp_path / "host_overhead.json")
    assert ab.main([path, path]) == 0
    assert ab.main([path]) == 2


def test_run_all_dry_run_writes_summary(tmp_path):
    mod = _script("run_all")
    rc = mod.main(["--dry-run", "--only", "fused,fused_verify", "--out", str(tmp_path), "--no-progress", "--no-plot"])
    assert rc == 0
    md = (tmp_path / "summary.md").read_text()
    assert "## fused\n" in md and "## fused_verify\n" in md and md.count("Copy ceiling") == 2


@pytest.mark.parametrize("name", ["bench_decode", "bench_prefill", "bench_cp"])
def test_family_scripts_dry_run(name, tmp_path):
    """The decode, prefill and context-parallel scripts accept the harness flags and dry-run on a CPU."""
    if not (BENCH / f"{name}.py").is_file():
        pytest.skip(f"{name}.py not there")
    mod = _script(name)
    src = (BENCH / f"{name}.py").read_text()
    if "harness" not in src:
        pytest.skip(f"{name}.py does not use the harness yet")
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--out", str(tmp_path)]) in (0, None)
    assert list(tmp_path.glob("*.json"))


def test_replot_draws_saved_results(tmp_path, capsys):
    """replot.py reads a results JSON back and draws its PNG beside it (when matplotlib is there)."""
    assert _script("bench_fused_decode").main(["--dry-run", "--no-progress", "--no-plot", "--out", str(tmp_path)]) == 0
    saved = tmp_path / "fused_decode.json"
    capsys.readouterr()
    assert _script("replot").main([str(saved)]) == 0
    printed = capsys.readouterr().out
    assert str(saved) in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in printed
    else:
        assert (tmp_path / "fused_decode.png").stat().st_size > 0
    assert _script("replot").main([]) == 2  # no file given: usage


@pytest.mark.parametrize("order", ["random", "sorted", "contiguous", "grouped"])
def test_decode_slot_orders(order, tmp_path):
    """bench_decode's --slot-order: every pattern gives rows unique in-range slots, in its order, and
    the dry run records the pattern in the results."""
    mod = _script("bench_decode")
    mod.DEVICE, mod.SLOTS = "cpu", 64
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 64):
        idx = mod.slot_list(rows, order, gen, mod.PAGE // 4)   # 4 slots a page
        assert idx.dtype == torch.int32 and idx.numel() == rows
        assert len(set(idx.tolist())) == rows and 0 <= int(idx.min()) and int(idx.max()) < 64
        if order in ("sorted", "contiguous"):
            assert torch.equal(idx, idx.sort().values)
        if order == "contiguous":
            assert int(idx[-1]) - int(idx[0]) == rows - 1
        if order == "grouped":   # whole page-aligned runs of 4, the last one cut at rows
            runs = idx.tolist()
            for i in range(0, rows, 4):
                assert runs[i] % 4 == 0 and runs[i:i + 4] == list(range(runs[i], runs[i] + len(runs[i:i + 4])))
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--slot-order", order, "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["meta"]["slot_order"] == order


def test_decode_pool_slots_option(tmp_path):
    """bench_decode's --slots sizes the pool (recorded in the results); fewer slots than a call's rows
    is refused before anything runs."""
    mod = _script("bench_decode")
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--slots", "48", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["meta"]["slots"] == 48
    with pytest.raises(SystemExit, match="--slots 2"):
        mod.main(["--dry-run", "--no-progress", "--no-plot", "--slots", "2", "--out", str(tmp_path)])


def test_decode_op_arm_and_summary(tmp_path):
    """bench_decode --op-arm times the public op beside the module's function; the summary quotes
    each against fla per timing mode, and the slot copies and the op (either arm) never count as "ours"."""
    mod = _script("bench_decode")
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--op-arm", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert all(set(c["arms"]) == {"ours", "op", "op_full"} for c in doc["cases"])
    t = lambda g, e, w: {"time_us": {"graph": {"median": g}, "eager": {"median": e}, "wall": {"median": w}}}  # noqa: E731
    results = [
        {"params": {"state": "f32", "heads": 8, "rows": 1, "module": "decode_split8_f32_o32"},
         "arms": {"ours": t(3, 10, 30), "op": t(3, 20, 60), "op_full": t(1, 1, 1), "fla": t(6, 100, 300),
                  "copy_p1": t(1, 1, 1)}},
        {"params": {"state": "f32", "heads": 8, "rows": 2, "module": "decode_split8_f32_o32"},
         "arms": {"ours": t(4, 10, 40), "op": t(4, 25, 80), "fla": t(4, 100, 160)}},
    ]
    s = mod.summarize(results, ["f32"])["f32"]
    assert s["points"] == 2
    assert s["ours_graph_geomean"] == pytest.approx(2 ** 0.5)        # 2x and 1x: the copy is not ours
    assert s["min_speedup_graph"] == pytest.approx(1.0)
    assert s["ours_eager_geomean"] == pytest.approx(10.0)
    assert s["op_eager_geomean"] == pytest.approx((5 * 4) ** 0.5)
    assert s["op_wall_geomean"] == pytest.approx((5 * 2) ** 0.5)
    assert s["geomean_speedup_eager"] == s["ours_wall_geomean"] == pytest.approx((10 * 4) ** 0.5)
    table = mod.markdown(results, 4.2)
    assert "| 8 | 1 | 3.0 (30) split8 |" in table and "3.00" in table    # ours / slot copy at 1 row


def test_decode_targets_reads_a_result_file(tmp_path, capsys):
    """decode_targets.py: misses per target, geomeans against fla, and the cap from the copy ceiling
    and a per-call floor, on a synthetic two-point result."""
    mod = _script("decode_targets")
    t = lambda g, w, pct=None: {"time_us": {"graph": {"median": g}, "eager": {"median": w}, "wall": {"median": w}},  # noqa: E731
                               "bandwidth": {"graph": {"pct_copy": pct}}}
    doc = {"copy_ceiling": {"GBps": 1000.0}, "cases": [
        {"params": {"state": "f32", "heads": 8, "rows": 16, "work_items": 128, "state_bytes": 2_000_000},
         "arms": {"ours": t(7.0, 30.0, 28.6), "fla": t(8.0, 100.0), "copy_p1": t(6.5, 20.0, 30.8)}},
        {"params": {"state": "f32", "heads": 64, "rows": 64, "work_items": 4096, "state_bytes": 100_000_000},
         "arms": {"ours": t(110.0, 120.0, 90.9), "fla": t(150.0, 160.0), "copy_p1": t(112.0, 120.0, 89.3)}},
    ]}
    r = mod.evaluate(doc, floors=(1.0,))["f32"]
    assert r["bandwidth_misses"] == []                               # 90.9% >= 90
    assert r["small_graph_misses"] == [(8, 16, 7.0, 6.5)]
    assert r["small_eager_misses"] == [(8, 16, 30.0)]
    assert r["not_faster_than_fla"] == []
    assert r["geomean"]["ours_graph"] == pytest.approx((8 / 7 * 150 / 110) ** 0.5)
    # best times: max(2 us, 1 us) = 2 us and max(100 us, 1 us) = 100 us
    assert r["cap"]["1 us"]["graph"] == pytest.approx((8 / 2 * 150 / 100) ** 0.5)
    assert r["cap"]["1 us"]["wall"] == pytest.approx((100 / 2 * 160 / 100) ** 0.5)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert mod.main([str(path), "--floors", "1"]) == 0
    assert "missed at 1: 8x16 7.00 us (slot copy 6.50)" in capsys.readouterr().out


def test_prefill_targets_reads_result_files(tmp_path, capsys):
    """prefill_targets.py: the bounded rows against the better of fla and FlashKDA's quoted times,
    the event and kernel geomeans over fla, and the 32768-token row, on a synthetic three-row result."""
    mod = _script("prefill_targets")
    t = lambda ev, k=None: {"time_us": {"eager": {"median": ev}, **({"kernel": {"median": k}} if k else {})}}  # noqa: E731
    row = lambda case, gate, ours, fla: {"params": {"case": case, "gate": gate},  # noqa: E731
                                         "arms": {"ours": ours, "fla": fla}}
    cases = [
        row("H16 4x64", "bounded", t(50.0, 25.0), t(1000.0, 60.0)),     # FlashKDA 43 us: not ahead
        row("H16 32768", "bounded", t(1200.0, 1150.0), t(2400.0, 2300.0)),  # FlashKDA 3670: fla is best
        row("H16 32768", "softplus", t(1250.0), t(2600.0)),
    ]
    r = mod.evaluate(cases)
    assert r["rows"] == 3
    assert r["not_ahead"] == [("H16 4x64 bounded", 50.0, "FlashKDA", 43.0)]
    assert [(n, w) for n, _, w in r["best"]] == [("H16 4x64 bounded", "FlashKDA"), ("H16 32768 bounded", "fla")]
    assert [x for _, x, _ in r["best"]] == pytest.approx([43 / 50, 2400 / 1200])
    assert [x for _, x in r["event"]] == pytest.approx([20.0, 2.0, 2600 / 1250])
    assert [x for _, x in r["kernel"]] == pytest.approx([60 / 25, 2300 / 1150])   # rows without kernel time skipped
    assert r["long"] == [("H16 32768 bounded", 1200.0), ("H16 32768 softplus", 1250.0)]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"cases": cases}))
    assert mod.main([str(path), str(path)]) == 0
    text = capsys.readouterr().out
    assert f"geomean {(43 / 50 * 2.0) ** 0.5:.2f}x (target 2x) over 2 rows; not ahead at 1" in text
    assert "H16 32768 softplus: 1.250 ms (target <= 0.5 ms)" in text and "== all files: 6 rows" in text


def test_kernel_mode_rounds_come_after_every_other_mode(tmp_path, monkeypatch):
    """Profiler sessions (kernel mode) must not sit between event samples: every eager / wall sample
    is taken before the first kernel-mode one, and each mode still interleaves the arms."""
    cfg = cpu_cfg(tmp_path, modes=("eager", "kernel", "wall"))
    monkeypatch.setattr(harness.Config, "is_cuda", property(lambda self: True))
    timer = harness.Timer(cfg)
    seen = []
    monkeypatch.setattr(timer, "sync", lambda: None)
    for mode, name in (("eager", "_events"), ("kernel", "_kernel"), ("wall", "_wall")):
        monkeypatch.setattr(timer, name, lambda run, n, mode=mode: (seen.append((mode, run())), [1.0] * n)[1])
    res = timer.measure([harness.Arm("a", lambda: "a"), harness.Arm("b", lambda: "b")])
    modes = [m for m, _ in seen]
    assert modes.index("kernel") > max(i for i, m in enumerate(modes) if m != "kernel")
    assert cfg.rounds == 2
    for mode in ("eager", "kernel", "wall"):
        assert [a for m, a in seen if m == mode] == ["a", "b", "b", "a"]
    assert all(res[a][m]["n"] == 4 for a in "ab" for m in ("eager", "kernel", "wall"))


def _argparse_main(path: Path) -> bool:
    text = path.read_text()
    return "def main(argv" in text and "ArgumentParser(" in text


SCRIPTS_WITH_MAIN = sorted(p.stem for p in BENCH.glob("*.py") if _argparse_main(p))


@pytest.mark.parametrize("name", SCRIPTS_WITH_MAIN)
def test_every_script_prints_its_help(name, capsys):
    """--help renders (argparse formats every help string: a bare '%' in one made bench_verify's raise)."""
    with pytest.raises(SystemExit) as done:
        _script(name).main(["--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_calls_per_graph_rotates_past_l2_within_the_cap():
    assert harness.calls_per_graph(128, 1e6) == 128         # small calls: the cap
    assert harness.calls_per_graph(128, 64e6) == 4          # 4 x 64 MB overflow L2
    assert harness.calls_per_graph(128, 4e9) == 2           # a huge call: still two input sets
    assert harness.calls_per_graph(1, 1e6) == 1             # one call a graph, as the engines time it
    assert harness.calls_per_graph(1, 4e9) == 1
    with pytest.raises(ValueError, match="max_calls"):
        harness.calls_per_graph(0, 1e6)


def test_decode_bench_routes_as_the_op_does(monkeypatch):
    """Its 'ours' arm is the module the op picks: an opt-in rule (persistent) is skipped unless opted in
    (the bench's own rule walk once took it for every unique-slot call)."""
    from flashkda_ext import dispatch
    mod = _script("bench_decode")
    monkeypatch.delenv("FLASHKDA_EXT_OPT_IN", raising=False)
    meta = dict(device="cuda", rows=1024, value_heads=8, work_items=8192, state="f32", offset="o32",
                slot_mode="unique", gate="softplus")
    module, rule = mod.route(meta)
    assert rule != "persistent" and not module.startswith("decode_stream")
    assert module == dispatch.module_name("kda_decode", meta)


def test_prefill_b1_filter_holds_in_both_grids():
    """--only-small / --skip-small pick the B=1 rows of the layer grid ("B1 T2048 H1") and of the issue46
    grid ("H8 B1 T2K"); the filter once read only the layer grid's names and left the issue46 grid empty."""
    bp = _script("bench_prefill")
    b1 = [c for c in bp.issue46_cases([8, 16], False) if bp.is_b1(c[0])]
    assert [c[0] for c in b1] == [f"H{h} B1 T{t}K" for h in (8, 16) for t in (2, 8, 32, 128)] + ["H64 B1 T8K"]
    assert all(len(c[1]) == 1 for c in b1)
    layer = [c for c in bp.cases([16], False) if bp.is_b1(c[0])]
    assert layer and all(c[0].startswith("B1 T") for c in layer)
    assert not bp.is_b1("H16 64x512") and not bp.is_b1("H32 4x4096")


def test_prefill_longest_routes_as_the_adapters_call(monkeypatch):
    """--longest gives the routes max_seqlen, so the rules that need it (c16g_mid at 16 x 1024 H8) are what an
    --opt-in-arm A/B measures; without it a like-length batch is routed by its mean."""
    bp = _script("bench_prefill")
    monkeypatch.setattr(bp, "DEVICE", "cuda")   # a dry run before this one leaves "cpu" there
    lens = [1024] * 16

    def flags(longest=False, known_lengths=False):
        return type("A", (), dict(longest=longest, known_lengths=known_lengths))
    assert bp.routed_longest(flags(), lens) is None
    assert bp.routed_longest(flags(longest=True), lens) == 1024
    assert bp.routed_longest(flags(known_lengths=True), lens) == 1024
    longest = bp.routed_longest(flags(longest=True), lens)
    assert bp.route_module(16, 8, sum(lens), "bounded", max_seqlen=longest) == "prefill_c16g_vt64_f32"
    assert bp.route_module(16, 8, sum(lens), "bounded") == "prefill_vt64_f32"


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_prefill_slow_keys_barely_decay(gate):
    """--slow-keys 2: the first two keys of every head decay by less than 1e-2 a token (the bench's model of
    long-memory channels), the other keys as before."""
    from flashkda_ext.reference.gates import gate_log_decay
    bp = _script("bench_prefill")
    H, K = 3, bp.K
    torch.manual_seed(1)
    d = bp.make([40], H, gate, torch.device("cpu"), slow_keys=2)
    torch.manual_seed(1)
    ref = bp.make([40], H, gate, torch.device("cpu"))
    lb = -5.0 if gate == "bounded" else None
    g = gate_log_decay(d["g"].float(), gate, d["A_log"], d["dt_bias"].view(H, K), lb)
    g0 = gate_log_decay(ref["g"].float(), gate, ref["A_log"], ref["dt_bias"].view(H, K), lb)
    assert g[..., :2].abs().max() < 1e-2 < g0[..., :2].abs().max()
    assert torch.equal(g[..., 2:], g0[..., 2:])


def test_replot_rebases_speedups_on_another_arm():
    """replot --baseline ARM: each other arm's speedup is ARM's median time over the arm's, in the primary mode;
    a case without ARM has none, and the saved results are not changed."""
    doc = {"primary_mode": "eager", "baseline": None, "cases": [
        {"name": "a", "arms": {"ours": {"time_us": {"eager": {"median": 2.0}}},
                               "cudnn": {"time_us": {"eager": {"median": 3.0}}},
                               "fla": {"time_us": {"eager": {"median": 8.0}}}}},
        {"name": "b", "arms": {"ours": {"time_us": {"eager": {"median": 5.0}}}}, "speedup": {"x": {"eager": 9.0}}}]}
    out = _script("replot").rebase(doc, "cudnn")
    assert out["baseline"] == "cudnn"
    assert out["cases"][0]["speedup"] == {"ours": {"eager": 1.5}, "fla": {"eager": 0.375}}
    assert "speedup" not in out["cases"][1]
    assert doc["baseline"] is None and "speedup" in doc["cases"][1]


def test_sglang_extend_batches_and_the_bounded_gate():
    """bench_sglang --extend-batches: '<requests>x<length>' parts joined by '+', so a long request among short ones is
    one batch; its inputs carry the host lengths SGLang passes and, with --gate bounded, Kimi K3's lower bound."""
    bs = _script("bench_sglang")
    assert bs.parse_batches("1x8000,1x4000+2x100") == [("1x8000", [8000]), ("1x4000+2x100", [4000, 100, 100])]
    with pytest.raises(SystemExit, match="extend-batches"):
        bs.parse_batches("4y100")
    gen = torch.Generator().manual_seed(3)
    args, kw = bs.extend_inputs([5, 0, 7], 2, torch.float32, gen, "cpu", slots=8, lower_bound=-5.0)
    assert kw["query_start_loc"].tolist() == [0, 5, 5, 12] and kw["extend_seq_lens_cpu"] == [5, 0, 7]
    assert kw["lower_bound"] == -5.0 and args[0].shape == (1, 12, 2, bs.K) and kw["cache_indices"].numel() == 3
