"""Opcode histogram (weighted by executions) of each kernel in an ncu SASS listing.

    ncu --metrics inst_executed --page source --print-source sass --csv ... > sass.csv
    python3 benchmarks/sass_histogram.py sass.csv
"""
import collections
import csv
import re
import sys


def main(path, top=20):
    kernels, name = collections.defaultdict(list), None
    for row in csv.reader(open(path)):
        if len(row) >= 2 and row[0] == "Kernel Name":
            name = row[1]
        elif name and len(row) >= 3 and row[0].startswith("0x"):
            kernels[name].append((row[1].strip(), int(row[2])))
    for name, insts in kernels.items():
        total = sum(c for _, c in insts)
        ops = collections.Counter()
        for text, count in insts:
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()
            ops[op[0].split(".")[0] if op else "?"] += count
        spills = sum(c for t, c in insts if re.search(r"\b(STL|LDL)", t))
        print(f"{name}: {len(insts)} static, {total} executed, local (spill) accesses {spills}")
        for op, count in ops.most_common(top):
            print(f"  {op:10s} {count:14d} {100 * count / total:5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1])
