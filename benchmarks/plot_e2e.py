"""Plots bench_e2e.py's results: ITL (and TTFT) against batch size, one line per method.

    PYTHONPATH=. python3 benchmarks/plot_e2e.py [results.json] [-o out.png]

Defaults: $OUT/bench_e2e.json (OUT defaults to ./out) -> bench_e2e.png beside it. Needs matplotlib.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402


def plot(results, path):
    """Writes a two-panel PNG (ITL p50, TTFT against batch) of a bench_e2e.json dict."""
    rows = [r for r in results["rows"] if "itl_ms_p50" in r]
    if not rows:
        raise ValueError("results holds no measured rows (all failed or skipped)")
    fig, (ax_itl, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["batch"])
        batches = [r["batch"] for r in mine]
        ax_itl.plot(batches, [r["itl_ms_p50"] for r in mine], "o-", label=method)
        ax_ttft.plot(batches, [r["ttft_ms"] for r in mine], "o-", label=method)
    all_batches = sorted({r["batch"] for r in rows})
    for ax, name in ((ax_itl, "ITL p50 (ms)"), (ax_ttft, "TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_batches)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("batch")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    # Results from before the layer-loop option ran the layers in one lax.scan.
    loop = {"unroll": "unrolled", "scan": "in a lax.scan"}[results.get("layer_loop", "scan")]
    fig.suptitle(f"{results['config']} ({results['num_layers']} layers {loop}, {results['dtype']}) on "
                 f"{results['device']}, prompts {results['prompt_len'][0]}-{results['prompt_len'][1]}, "
                 f"{results['out_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", default=os.path.join(os.environ.get("OUT", "out"), "bench_e2e.json"),
                    help="bench_e2e.py's results (default $OUT/bench_e2e.json, OUT defaulting to ./out)")
    ap.add_argument("-o", "--output", default=None, help="PNG path (default: the results path with .png)")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    path = args.output or os.path.splitext(args.results)[0] + ".png"
    plot(results, path)
    print(path)


if __name__ == "__main__":
    main()
