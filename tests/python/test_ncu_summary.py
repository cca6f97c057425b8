"""src/cuda/tools/ncu_summary.py on synthetic CSV pages shaped as `ncu --import --csv` prints them
(a profile costs a device call: the summary must read what comes back)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src", "cuda", "tools"))
import ncu_summary  # noqa: E402

METRICS = [
    "gpu__time_duration.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic",
    "launch__shared_mem_per_block_static",
    "launch__grid_size",
    "launch__block_size",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
]
UNITS = ["nsecond", "%", "%", "%", "register/thread", "byte", "byte", "", "", "", "", "", ""]


def raw_page(path, kernels):
    """kernels: (name, [value per METRICS])."""
    lines = ["==PROF== Disconnected from process 1234"]
    lines.append(",".join(f'"{x}"' for x in ["ID", "Kernel Name", *METRICS]))
    lines.append(",".join(f'"{x}"' for x in ["", "", *UNITS]))
    for i, (name, vals) in enumerate(kernels):
        lines.append(",".join(f'"{x}"' for x in [i, name, *vals]))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_table_side_by_side(tmp_path, capsys):
    fa4 = raw_page(
        tmp_path / "fa4.csv",
        [
            ("kernel_cutlass_flash_fwd_sm90FlashAttentionForwardSm90_object_at_0x", [
                "712,000", 35.2, 60.1, 12.4, 168, 200704, 0, 132, 384, 1.0, 3.0, 1.0, 0.5]),
            ("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>(int, dq_t)", [
                3000, 5, 0, 50, 16, 0, 0, 1024, 128, 0, 1, 1, 0]),
            ("kernel_cutlass_FlashAttentionBackwardPreprocess_object", [
                20000, 10, 0, 60, 32, 0, 0, 512, 128, 0, 2, 1, 0]),
            ("kernel_cutlass_FlashAttentionBackwardSm90_object", [
                2000000, 40, 55, 12, 240, 150000, 1024, 132, 384, 4, 1, 1, 1]),
            ("kernel_cutlass_FlashAttentionBackwardPostprocess_object", [
                50000, 8, 0, 70, 40, 0, 0, 512, 256, 0, 3, 1, 0]),
        ],
    )  # fmt: skip
    dkv = raw_page(
        tmp_path / "dualkv.csv",
        [
            ("void dualkv::cuda::detail::fwd_ws_kernel_sm90<bf16, 128>(FwdWsArgs)", [
                800000, 30, 50, 12, 168, 190000, 0, 132, 384, 2, 2, 1, 0]),
            ("void dualkv::cuda::detail::bwd_pre_kernel<bf16, 128>(BwdParams, bool)", [
                25000, 9, 0, 55, 30, 0, 0, 512, 256, 0, 1, 1, 0]),
            ("dkdv_ws_kernel_sm90", [2400000, 38, 48, 12, 240, 220000, 0, 132, 384, 5, 1, 1, 0]),
            ("dq_convert_kernel", [40000, 7, 0, 66, 24, 0, 0, 512, 256, 0, 1, 1, 0]),
        ],
    )  # fmt: skip
    ncu_summary.table([f"fa4={fa4}", f"dualkv={dkv}", f"none={tmp_path / 'missing.csv'}"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "none: no kernels in " + str(tmp_path / "missing.csv")
    body = [ln.split()[:3] for ln in out[2:11]]
    assert body == [
        ["fwd", "fa4", "FlashAttentionForwardSm90"],
        ["fwd", "dualkv", "fwd_ws_kernel_sm90"],
        ["pre", "fa4", "FlashAttentionBackwardPreprocess"],
        ["pre", "dualkv", "bwd_pre_kernel"],
        ["bwd", "fa4", "FlashAttentionBackwardSm90"],
        ["bwd", "dualkv", "dkdv_ws_kernel_sm90"],
        ["dq", "fa4", "FlashAttentionBackwardPostprocess"],
        ["dq", "dualkv", "dq_convert_kernel"],
        ["other", "fa4", "vectorized_elementwise_kernel"],
    ]
    fwd = out[2].split()
    # 712,000 ns; issue, tensor, occupancy, registers; 200704 B = 196 KiB; stalls without
    # "selected" (the warp issuing), shares of 4.5
    assert fwd[3:9] == ["0.712", "35.2", "60.1", "12.4", "168", "196.0"]
    assert out[2].endswith("132 x 384  long_scoreboard 67%, barrier 22%, wait 11%")
    assert out[3].endswith("x 384  long_scoreboard 50%, barrier 50%")  # no 0% reason listed
    assert out[11] == "total fa4: 2.785 ms (fwd 0.712, pre 0.020, bwd 2.000, dq 0.050, other 0.003)"
    assert out[12] == "total dualkv: 3.265 ms (fwd 0.800, pre 0.025, bwd 2.400, dq 0.040)"


def test_source_page_of_several_kernels(tmp_path, capsys):
    head = '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier"'
    page = [
        '"Kernel Name","fwd_ws_kernel_sm90"',
        head,
        '"0x10","HGMMA.64x128x16","30","5"',
        '"0x20","BAR.SYNC","70","60"',
        '"Kernel Name","dkdv_ws_kernel_sm90"',
        head,
        '"0x30","LDS.128","9","1"',
    ]
    path = tmp_path / "source.csv"
    path.write_text("\n".join(page) + "\n")
    ncu_summary.source_summary(ncu_summary.read_csv(str(path)))
    out = capsys.readouterr().out
    assert out.count("== kernel: ") == 2 and "(100 samples)" in out and "(9 samples)" in out
    assert out.index("BAR.SYNC") < out.index("HGMMA") < out.index("dkdv_ws_kernel_sm90")
