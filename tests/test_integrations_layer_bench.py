"""benchmarks/bench_layer.py dry-runs on the CPU (tiny layer, no fla): the script's logic, its JSON, and that
the compiled arm (torch.compile fullgraph over the layer's decode step) agrees with the eager one."""
import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_layer_benchmark_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_layer", ROOT / "benchmarks" / "bench_layer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch._dynamo.reset()
    assert mod.main(["--dry-run", "--no-progress", "--no-plot", "--prefill", "64", "--rows", "2",
                     "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "layer.json").read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    assert set(cases) == {"prefill T=64", "decode rows=2", "adapter casts rows=2"}
    assert set(cases["decode rows=2"]["arms"]) == {"ours", "ours_compiled"}
    # fp32 gate / beta: native reads and the casts they replaced, side by side
    assert set(cases["adapter casts rows=2"]["arms"]) == {"ours", "ours_fp32_gate_beta", "ours_fp32_cast"}
    for c in cases.values():
        for arm in c["arms"].values():
            assert arm["time_us"]["wall"]["median"] > 0

    # the compiled decode step equals the eager one on the same state
    layer = mod.KDALayer(mod.TINY, torch.device("cpu"), torch.float32, 6, torch.Generator().manual_seed(0))
    x, idx = torch.randn(2, mod.TINY["hidden"]), torch.tensor([4, 1], dtype=torch.int32)
    state, conv = layer.state.clone(), layer.conv_state.clone()
    want = layer.decode(x, idx, "ours")
    layer.state.copy_(state)
    layer.conv_state.copy_(conv)
    got = torch.compile(lambda a, b: layer.decode(a, b, "ours"), fullgraph=True, backend="aot_eager")(x, idx)
    assert torch.equal(got, want)
