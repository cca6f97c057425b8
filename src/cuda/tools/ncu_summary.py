"""Text summary of Nsight Compute reports, from the CSV pages that `ncu --import` prints (so the
reports themselves need not be opened to act on them):

    ncu --import R.ncu-rep --page raw --csv > raw.csv
    ncu --import R.ncu-rep --page source --csv --print-source sass > source.csv
    python3 src/cuda/tools/ncu_summary.py raw.csv source.csv > summary.txt

Prints, per kernel of the report, a few headline metrics (duration, tensor pipe, issue slots,
occupancy, registers, shared memory, L2, DRAM), the warp stall reasons sorted by their share (per
issued instruction and sampled), and the SASS lines with the most stall samples. Either file may
be missing or empty; what is there is summarised.

    ncu --import A.ncu-rep --page raw --csv --print-units base > a.csv   # (and b.csv)
    python3 src/cuda/tools/ncu_summary.py --table fa4=a.csv dualkv=b.csv

prints the kernels of several reports side by side, one line each, grouped by role (forward,
backward preprocess, backward main loop, dQ pass / postprocess, other): time, issue slots used,
tensor pipe active, achieved occupancy, registers per thread, shared memory per block, launch
shape and the largest stall reasons, then each report's total time per role.
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
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic",
    "launch__shared_mem_per_block_static",
    "launch__grid_size",
    "launch__block_size",
]
STALL = r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio"


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
            (STALL, "per issue"),
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
    """The hottest SASS lines of each kernel on the source page (ncu prints one "Kernel Name",
    <name> line above each kernel's table)."""
    starts = [i for i, r in enumerate(rows) if r and r[0].strip() == "Kernel Name"] or [-1]
    if len(starts) > 1:
        top = min(top, 15)
    for a, b in zip(starts, starts[1:] + [len(rows)]):
        if a >= 0:
            print(f"== kernel: {rows[a][1][:150] if len(rows[a]) > 1 else '?'}")
        kernel_source_summary(rows[a + 1 : b], top)


def kernel_source_summary(rows: list[list[str]], top: int) -> None:
    if len(rows) < 2:
        print("source page: no data")
        return
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


# The columns of --table: (title, metric names in order of preference).
TABLE = [
    ("issue%", ["smsp__issue_active.avg.pct_of_peak_sustained_active"]),
    (
        "tensor%",  # the wgmma/mma pipe's active cycles (ncu's name keeps "hmma" on Hopper)
        [
            "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        ],
    ),
    ("occ%", ["sm__warps_active.avg.pct_of_peak_sustained_active"]),
    ("regs", ["launch__registers_per_thread"]),
]
ROLES = [  # (role, pattern of the kernel name), first match wins; printed in launch order
    ("pre", r"preprocess|bwd_pre"),
    ("dq", r"postprocess|convert|dq_"),
    ("bwd", r"backward|bwd|dkdv"),
    ("fwd", r"forward|fwd"),
]
SCALE = {  # unit -> base unit (--print-units base gives seconds' and bytes' base units)
    "nsecond": 1e-9,
    "usecond": 1e-6,
    "msecond": 1e-3,
    "second": 1.0,
    "byte": 1.0,
    "Kbyte": 1e3,
    "Mbyte": 1e6,
    "KB": 1e3,
    "MB": 1e6,
}


def kernels(rows: list[list[str]]) -> list[dict[str, tuple[str, str]]]:
    """The raw page's kernels: {metric: (value, unit)} each."""
    if len(rows) < 3:
        return []
    names, units = rows[0], rows[1]
    return [{n: (v, u) for n, u, v in zip(names, units, vals)} for vals in rows[2:]]


def base(k: dict[str, tuple[str, str]], metric: str) -> float | None:
    value, unit = k.get(metric, ("", ""))
    v = number(value)
    return None if v is None else v * SCALE.get(unit.strip(), 1.0)


def role_of(name: str) -> str:
    """The role of a kernel by its name without template and parameter types."""
    low = name.split("(")[0].split("<")[0].lower()
    return next((role for role, pat in ROLES if re.search(pat, low)), "other")


def short_name(name: str) -> str:
    """FA4's CuTe DSL kernels by their class (FlashAttentionForwardSm90, ...), others by their
    function name without namespace, template arguments and parameters."""
    m = re.search(r"FlashAttention[A-Za-z0-9]*?(?:Sm\d+|(?=[^A-Za-z0-9])|$)", name)
    if m:
        return m.group(0)
    return name.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "").strip()[:34]


def table(specs: list[str]) -> None:
    entries = []  # (role order, report order, launch order, label, kernel)
    order = ["fwd", "pre", "bwd", "dq", "other"]
    for ri, spec in enumerate(specs):
        label, _, path = spec.partition("=")
        found = kernels(read_csv(path))
        if not found:
            print(f"{label}: no kernels in {path}")
        for ki, k in enumerate(found):
            name = k.get("Kernel Name", ("?", ""))[0]
            entries.append((order.index(role_of(name)), ri, ki, label, k))
    head = f"{'role':<5} {'impl':<10} {'kernel':<34} {'ms':>8}"
    head += "".join(f" {t:>7}" for t, _ in TABLE) + f" {'smem KiB':>8} {'grid x block':>14}  stalls"
    print(head)
    totals: dict[tuple[str, str], float] = {}
    for ro, _, _, label, k in sorted(entries, key=lambda e: e[:3]):
        name = k.get("Kernel Name", ("?", ""))[0]
        t = base(k, "gpu__time_duration.sum")
        totals[(label, order[ro])] = totals.get((label, order[ro]), 0.0) + (t or 0.0)
        cells = []
        for title, metrics in TABLE:
            v = next((x for m in metrics if (x := base(k, m)) is not None), None)
            digits = 0 if title == "regs" else 1
            cells.append(f" {v:7.{digits}f}" if v is not None else f" {'-':>7}")
        smem = [base(k, f"launch__shared_mem_per_block_{s}") for s in ("dynamic", "static")]
        kib = f"{sum(x or 0.0 for x in smem) / 1024:8.1f}" if any(smem) else f"{'-':>8}"
        grid, block = (k.get(f"launch__{x}_size", ("?", ""))[0] for x in ("grid", "block"))
        stalls = []
        for metric, (value, _) in k.items():
            mt = re.fullmatch(STALL, metric)
            v = number(value)
            if mt and v is not None and mt.group(1) != "selected":  # selected: issuing
                stalls.append((v, mt.group(1)))
        total = sum(v for v, _ in stalls) or 1.0
        top = ", ".join(
            f"{r} {100 * v / total:.0f}%"
            for v, r in sorted(stalls, reverse=True)[:3]
            if v >= total / 100
        )
        ms = f"{1e3 * t:8.3f}" if t is not None else f"{'-':>8}"
        print(
            f"{order[ro]:<5} {label:<10} {short_name(name):<34} {ms}{''.join(cells)} {kib} "
            f"{grid + ' x ' + block:>14}  {top}"
        )
    for label in dict.fromkeys(e[3] for e in entries):
        parts = [f"{r} {1e3 * totals[(label, r)]:.3f}" for r in order if (label, r) in totals]
        whole = sum(v for (lb, _), v in totals.items() if lb == label)
        print(f"total {label}: {1e3 * whole:.3f} ms ({', '.join(parts)})")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--table":
        table(sys.argv[2:])
        return
    if len(sys.argv) > 1:
        raw_summary(read_csv(sys.argv[1]))
    if len(sys.argv) > 2:
        source_summary(read_csv(sys.argv[2]))


if __name__ == "__main__":
    main()
