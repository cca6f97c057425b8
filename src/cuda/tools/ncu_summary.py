"""Text summary of one kernel's Nsight Compute report, from the CSV pages that `ncu --import`
prints (so the report itself need not be opened to act on it):

    ncu --import R.ncu-rep --page raw --csv > raw.csv
    ncu --import R.ncu-rep --page source --csv --print-source sass > source.csv
    python3 src/cuda/tools/ncu_summary.py raw.csv source.csv > summary.txt

Prints a few headline metrics (duration, tensor pipe, shared memory, L2, DRAM), the warp stall
reasons sorted by their share (per issued instruction and sampled), and the SASS lines with the
most stall samples. Either file may be missing or empty; what is there is summarised.
"""

import csv
import io
import re
import sys

HEADLINE = [
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",
    "smsp__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_op_red.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "smsp__average_warp_latency_per_inst_issued.ratio",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
]


def read_csv(path: str) -> list[list[str]]:
    try:
        with open(path, newline="") as f:
            text = f.read()
    except OSError:
        return []
    # The table starts at the first quoted line (ncu may print other lines before it).
    lines = text.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.startswith('"')), len(lines))
    lines = [ln for ln in lines[first:] if not ln.startswith("==")]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def raw_summary(rows: list[list[str]]) -> None:
    # Header row (metric names), a units row, then one row per profiled kernel.
    if len(rows) < 3:
        print("raw page: no data")
        return
    names, units = rows[0], rows[1]
    for k, vals in enumerate(rows[2:]):
        col = {n: i for i, n in enumerate(names)}
        kname = vals[col["Kernel Name"]] if "Kernel Name" in col else "?"
        print(f"== kernel {k}: {kname[:150]}")
        for m in HEADLINE:
            if m in col:
                print(f"  {m:80s} {vals[col[m]]:>16s} {units[col[m]]}")
        for pat, title in [
            (r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio", "per issue"),
            (r"smsp__pcsamp_warps_issue_stalled_(\w+)$", "sampled"),
        ]:
            found = []
            for i, n in enumerate(names):
                mt = re.fullmatch(pat, n)
                v = number(vals[i]) if mt and i < len(vals) else None
                if mt and v is not None:
                    found.append((v, mt.group(1)))
            total = sum(v for v, _ in found) or 1.0
            print(f"  stall reasons ({title}), largest first:")
            for v, r in sorted(found, reverse=True)[:12]:
                print(f"    {r:32s} {v:14.3f} {100 * v / total:6.1f}%")


def source_summary(rows: list[list[str]], top: int = 30) -> None:
    if len(rows) < 2:
        print("source page: no data")
        return
    # ncu prints one "Kernel Name", <name> line above the source page's header.
    if rows[0] and rows[0][0].strip() == "Kernel Name":
        rows = rows[1:]
    head = rows[0]
    src = next((i for i, h in enumerate(head) if h.strip() == "Source"), None)
    addr = next((i for i, h in enumerate(head) if "Address" in h), None)
    samp = next((i for i, h in enumerate(head) if "Warp Stall Sampling (All" in h), None)
    if src is None or samp is None:
        print("source page: columns not found:", head[:12])
        return
    stall_cols = [
        i for i, h in enumerate(head) if "stall" in h.lower() and i != samp and "Sampling" not in h
    ]
    body = [r for r in rows[1:] if len(r) == len(head) and number(r[samp]) is not None]
    total = sum(number(r[samp]) or 0.0 for r in body) or 1.0
    print(f"== hottest SASS lines by warp stall samples ({int(total)} samples)")
    for r in sorted(body, key=lambda r: -(number(r[samp]) or 0.0))[:top]:
        v = number(r[samp]) or 0.0
        reasons = sorted(((number(r[i]) or 0.0, head[i]) for i in stall_cols), reverse=True)[:3]
        why = ", ".join(f"{h.strip()} {x:.0f}" for x, h in reasons if x > 0)
        a = r[addr] if addr is not None else ""
        print(f"  {100 * v / total:5.1f}% {a:>8s}  {r[src].strip()[:70]:70s} {why}")


def main() -> None:
    if len(sys.argv) > 1:
        raw_summary(read_csv(sys.argv[1]))
    if len(sys.argv) > 2:
        source_summary(read_csv(sys.argv[2]))


if __name__ == "__main__":
    main()
