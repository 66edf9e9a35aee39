"""The engine-wheel cache under concurrent processes (the test command runs two pytest workers): one download, and
no process reads a wheel or an extracted file another is still writing. Plus the README's test command is the one
.ci/run runs."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import engine_wheels  # noqa: E402

# a stand-in for `pip download`: counts its runs, then writes the wheel in two parts, slowly
FAKE_PIP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    dest, count = Path(sys.argv[-1]), Path(sys.argv[1])
    with open(count, "a") as f:
        f.write("run\\n")
    with open(dest / "fakeproj-1.0-py3-none-any.whl", "w") as f:
        f.write("first half ")
        f.flush()
        time.sleep(0.5)
        f.write("second half")
""")

FETCH = textwrap.dedent("""
    import sys
    sys.path.insert(0, {scripts!r})
    import engine_wheels
    from pathlib import Path
    wheel = engine_wheels.find_wheel("fakeproj", "1.0", cache=Path({cache!r}),
                                     pip=[sys.executable, {pip!r}, {count!r}])
    print(wheel.read_text())
""")


def test_two_processes_download_once_and_read_the_whole_wheel(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHKDA_EXT_ENGINE_WHEELS", raising=False)
    pip, count, cache = tmp_path / "pip.py", tmp_path / "count", tmp_path / "cache"
    pip.write_text(FAKE_PIP)
    code = FETCH.format(scripts=str(ROOT / "scripts"), cache=str(cache), pip=str(pip), count=str(count))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert [o.strip() for o, _ in outs] == ["first half second half"] * 2
    assert count.read_text().splitlines() == ["run"]
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["fakeproj-1.0-py3-none-any.whl"]


def test_a_failed_download_leaves_no_wheel_and_names_the_project(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHKDA_EXT_ENGINE_WHEELS", raising=False)
    with pytest.raises(RuntimeError, match=r"fakeproj==1.0: no local wheel and pip download failed"):
        engine_wheels.find_wheel("fakeproj", "1.0", cache=tmp_path,
                                 pip=[sys.executable, "-c", "import sys; sys.exit('no network')"])
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    prefix = "    bash scripts/install.sh && "
    commands = [line[len(prefix):] for line in readme if line.startswith(prefix)]
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, commands
    assert tests[0] in ci, f"README's test command {tests[0]!r} is not a line of .ci/run"
