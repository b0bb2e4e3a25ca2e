"""benchmarks/regress.py: --help without JAX, the row table, the marks, and a smoke run of two rows."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import regress  # noqa: E402  (imports no JAX)


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw)


def test_help_imports_no_jax():
    code = ("import runpy, sys\n"
            "sys.argv = ['regress.py', '--help']\n"
            "try:\n    runpy.run_path('benchmarks/regress.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert 'jax' not in sys.modules, 'regress.py --help imported jax'\n")
    out = _run(["-c", code], timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--update" in out.stdout and "cascade auto B64 prefix32768" in out.stdout


def test_rows_are_unique_and_many():
    names = [r.name for r in regress.ROWS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    assert all(callable(r.build) and 0 < r.tol < 0.1 for r in regress.ROWS)


def test_marks():
    ok = {"name": "r", "tol": 2e-2, "median_us": 106.0, "rel_err": 3e-3, "nan": False}
    assert regress.status(ok, {"median_us": 100.0}) == "SLOWER"
    assert regress.status(ok, {"median_us": 102.0}) == ""
    assert regress.status(ok, {"median_us": 120.0}) == "faster"
    assert regress.status(ok, None) == "new"
    assert regress.status(ok | {"rel_err": 5e-2}, {"median_us": 106.0}) == "BAD"
    assert regress.status(ok | {"rel_err": float("nan")}, None) == "BAD"
    assert regress.status(ok | {"nan": True}, None) == "BAD"
    assert regress.status({"name": "r", "tol": 2e-2, "error": "ValueError: x"}, None) == "ERROR"
    text = regress.table([ok | {"mark": "SLOWER"}], {"r": {"median_us": 100.0}})
    assert "1.060" in text and "SLOWER" in text


def test_smoke_two_rows(tmp_path):
    """Both builders end to end in interpret mode: checked against the reference, timed."""
    path = tmp_path / "smoke.json"
    out = _run(["benchmarks/regress.py", "--smoke", "--rows", r"^(decode B16 kv1024|ragged softcap30.*)$",
                "--json", str(path)], timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(path.read_text())["results"]
    assert [r["name"] for r in results] == ["decode B16 kv1024", "ragged softcap30 B16 S4096 16/16"]
    for r in results:
        assert r["rel_err"] < r["tol"] and not r["nan"] and r["median_us"] > 0, r


@pytest.mark.parametrize("args", [["--smoke", "--update"], ["--rows", "no such row"]])
def test_refuses(args):
    out = _run(["benchmarks/regress.py", *args], timeout=60)
    assert out.returncode == 2, out.stderr


@pytest.mark.slow  # a benchmark tool's smoke run; test_smoke_two_rows runs regress.py
def test_ab_smoke_one_row(tmp_path):
    """benchmarks/ab.py end to end: one round of each tree (both this repo here), one row, its table."""
    path = tmp_path / "ab.json"
    out = _run(["benchmarks/ab.py", "--base", ROOT, "--rows", r"^decode B16 kv1024$", "--rounds", "1", "--smoke",
                "--json", str(path), "--new-env", "JAXINFER_BACKEND=interpret"], timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = json.loads(path.read_text())
    assert [len(runs["base"]), len(runs["new"])] == [1, 1]
    assert all(run["decode B16 kv1024"]["median_us"] > 0 for run in runs["base"] + runs["new"])
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("decode B16 kv1024") and last.split()[-1] != "-", last


def test_ab_refuses_bad_arguments(tmp_path):
    out = _run(["benchmarks/ab.py", "--base", str(tmp_path), "--rows", "x"], timeout=60)
    assert out.returncode == 2 and "holds no benchmarks/regress.py" in out.stderr, out.stderr
    out = _run(["benchmarks/ab.py", "--base", ROOT, "--rows", "x", "--new-env", "NOVALUE"], timeout=60)
    assert out.returncode == 2 and "NAME=VALUE" in out.stderr, out.stderr


@pytest.mark.slow
def test_ab_side_env_reaches_its_runs():
    """--new-env reaches the new tree's regress.py run (here an XLA flag XLA rejects: that run
    fails, and ab.py says so with its output)."""
    out = _run(["benchmarks/ab.py", "--base", ROOT, "--rows", r"^decode B16 kv1024$", "--rounds", "1", "--smoke",
                "--new-env", "XLA_FLAGS=--xla_no_such_flag"], timeout=300)
    assert out.returncode != 0 and "regress.py exited" in out.stderr and "xla_no_such_flag" in out.stderr, out.stderr
