"""A/B two source trees on regress.py rows, on one machine in one call: rounds of regress.py
runs, alternating the trees (base, new; then new, base; ...) so that drift between runs (a
machine warming up, another process) falls on both, then one table of both trees' medians.
METHOD.md's rule: compare changes within one call, since the same row moves ~2% between
machines.

    # here: the base tree is a copy of another commit's code in an ignored folder (carry it)
    mkdir -p .carry/base && git archive main jaxinfer pallas_kernels planner benchmarks | tar -x -C .carry/base
    # on the device machine (the repo root is the cwd):
    python3 benchmarks/ab.py --base .carry/base --rows 'ragged_paged_attention|told bf16' --rounds 2

Each run is `python3 TREE/benchmarks/regress.py --rows ROWS --baseline NONE --json ...` with
PYTHONPATH=TREE, so each tree times its own kernels, planner and rows. --base-env / --new-env
NAME=VALUE (repeatable) set variables for one side's runs (an XLA flag, an experiment's switch);
--base may then be this repo too. --smoke passes through (interpret mode, tiny shapes: a CPU
check of the script). --json writes every run's results.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tree(tree, rows, smoke, timeout_s, env_vars=()):
    """One regress.py run of the tree (env_vars: NAME=VALUE strings): {row name: result dict},
    or raises with its output."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, os.path.join(tree, "benchmarks", "regress.py"), "--rows", rows,
               "--baseline", os.path.join(tmp, "none.json"), "--json", out] + ["--smoke"] * smoke
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), **dict(v.split("=", 1) for v in env_vars))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if not os.path.exists(out):
            tail = proc.stdout[-3000:] + proc.stderr[-3000:]
            raise RuntimeError(f"{tree}: regress.py exited {proc.returncode}\n{tail}")
        with open(out) as f:
            return {r["name"]: r for r in json.load(f)["results"]}


def table(names, runs):
    """Rows x (base runs, new runs, new / base of the medians); errors and BAD rows say so."""
    lines = [f"{'row':<76} {'base us':>17} {'new us':>17} {'new/base':>8}"]
    for name in names:
        cols, medians = [], []
        for side in ("base", "new"):
            results = [r.get(name, {}) for r in runs[side]]
            us = [r["median_us"] for r in results if r.get("median_us") is not None]
            bad = [r.get("error") or r.get("mark") for r in results if r.get("error") or r.get("mark") == "BAD"]
            cols.append(" / ".join(f"{x:.1f}" for x in us) + (f" {bad[0]}" if bad else ""))
            medians.append(statistics.median(us) if us else None)
        ratio = f"{medians[1] / medians[0]:.3f}" if None not in medians else "-"
        lines.append(f"{name[:76]:<76} {cols[0]:>17} {cols[1]:>17} {ratio:>8}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True,
                    help="the base tree (holds jaxinfer, pallas_kernels, planner, benchmarks)")
    ap.add_argument("--new", default=ROOT, help="the new tree (default: this repo)")
    ap.add_argument("--rows", required=True, help="regress.py --rows: a regular expression over row names")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree (default: %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="regress.py --smoke (CPU, interpret mode)")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per regress.py run")
    ap.add_argument("--json", help="write {base: [runs], new: [runs]} here")
    for side in ("base", "new"):
        ap.add_argument(f"--{side}-env", action="append", default=[], metavar="NAME=VALUE",
                        help=f"an environment variable for the {side} tree's runs (repeatable)")
    args = ap.parse_args(argv)
    envs = {"base": args.base_env, "new": args.new_env}
    for v in envs["base"] + envs["new"]:
        if "=" not in v:
            ap.error(f"environment settings are NAME=VALUE, got {v!r}")
    trees = {"base": args.base, "new": args.new}
    for side, tree in trees.items():
        if not os.path.exists(os.path.join(tree, "benchmarks", "regress.py")):
            ap.error(f"--{side} {tree!r} holds no benchmarks/regress.py")
    runs, names = {"base": [], "new": []}, []
    start = time.perf_counter()
    for r in range(args.rounds):
        for side in ("base", "new") if r % 2 == 0 else ("new", "base"):
            res = run_tree(trees[side], args.rows, args.smoke, args.timeout, envs[side])
            runs[side].append(res)
            names += [n for n in res if n not in names]
            print(f"[round {r + 1} {side} {time.perf_counter() - start:6.1f}s] "
                  + "; ".join(f"{n}: {x.get('median_us') or 0:.1f}" for n, x in res.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    print(table(names, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
