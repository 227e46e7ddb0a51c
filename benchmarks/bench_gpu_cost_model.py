"""Leave-one-model-out check of the GPU kernel cost model on Vidur's H100/A100 profiles.

For each GPU and each model in its tables: fit the kernel parameters on the other models
(``validate.kernel_fit``), predict the held-out model's non-attention step time (every layer's
operators plus, under TP, two all-reduces per layer priced from the fitted NCCL model) at every
token count and TP degree it has, and compare with the measured time (the sum of the measured
operators plus the measured all-reduce at that message size). The same figures for the
datasheet roofline, at the cost model's old default efficiencies (compute 0.6, bandwidth 0.8)
and at the efficiencies fitted on the same held-in models.

    python benchmarks/bench_gpu_cost_model.py [--vidur ../shared/data/vidur] [--no-throttle]

``--no-throttle`` fits the kernel model without its power-cap term (the model before it).

Attention is not in these tables, so it is not in these figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.config.hardware import resolve_hardware  # noqa: E402
from sim.gpu_kernels import allreduce_time_s  # noqa: E402
from validate.kernel_fit import (  # noqa: E402
    fit_kernel_params,
    fit_roofline,
    measured_layer_s,
    predicted_layer_s,
    roofline_layer_s,
)
from validate.vidur_profile import VIDUR_GPUS  # noqa: E402
from validate.vidur_tables import OperatorTables, layer_shape, read_tables  # noqa: E402

OLD_ROOFLINE = (0.6, 0.8)  # CostParams' compute/bandwidth efficiency before the kernel fit
REGIMES = {"decode 1-256": (1, 256), "prefill 512-4096": (512, 4096)}  # tokens per step


def measured_allreduce_s(tables: OperatorTables, tp: int, nbytes: np.ndarray) -> np.ndarray:
    """The measured all-reduce time at ``nbytes``, interpolated in log-log between sizes."""
    rows = tables.allreduce[tables.allreduce["tensor_parallel_size"] == tp]
    if rows.empty:
        raise SystemExit(f"{tables.gpu}: no all-reduce measurements at TP {tp}")
    x, y = np.log(rows["bytes"].to_numpy()), np.log(rows["time_s"].to_numpy())
    return np.exp(np.interp(np.log(nbytes), x, y))


def lomo(tables: OperatorTables, hardware_name: str, throttle: bool = True) -> pd.DataFrame:
    hardware = resolve_hardware(hardware_name)
    out = []
    for held in tables.models:
        train = OperatorTables(
            tables.gpu, tables.layers[tables.layers["model"] != held], tables.allreduce
        )
        test = tables.layers[tables.layers["model"] == held].reset_index(drop=True)
        params = fit_kernel_params(train, hardware, throttle=throttle)
        fitted_roofline = fit_roofline(train.layers, hardware)
        frame = test[["model", "num_tokens", "num_tensor_parallel_workers"]].copy()
        frame["measured"] = measured_layer_s(test)
        frame["kernel"] = predicted_layer_s(test, params, hardware)
        frame["roofline_old"] = roofline_layer_s(test, hardware, *OLD_ROOFLINE)
        frame["roofline_fit"] = roofline_layer_s(test, hardware, *fitted_roofline)
        # Two all-reduces per layer under TP: measured vs the fitted NCCL model.
        for tp, idx in frame.groupby("num_tensor_parallel_workers").groups.items():
            if tp == 1:
                continue
            shape = layer_shape(test.loc[idx[0]])
            nbytes = frame.loc[idx, "num_tokens"].to_numpy(float) * shape.hidden * 2
            frame.loc[idx, "measured"] += 2 * measured_allreduce_s(tables, int(tp), nbytes)
            fit = params.allreduce_fit(int(tp))
            assert fit is not None
            frame.loc[idx, "kernel"] += 2 * allreduce_time_s(nbytes, fit)
            # The roofline's all-reduce: CostParams' 10 us latency + NVLink bytes.
            link = hardware.allreduce_bandwidth_bytes_per_s
            roof_ar = 2 * (1e-5 + nbytes * 2 * (tp - 1) / tp / link)
            frame.loc[idx, "roofline_old"] += roof_ar
            frame.loc[idx, "roofline_fit"] += roof_ar
        frame["gpu"] = tables.gpu
        out.append(frame)
    return pd.concat(out, ignore_index=True)


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (gpu, tp_group), group in results.groupby(
        ["gpu", np.where(results["num_tensor_parallel_workers"] == 1, "TP1", "TP2-8")]
    ):
        for regime, (lo, hi) in REGIMES.items():
            sel = group[(group["num_tokens"] >= lo) & (group["num_tokens"] <= hi)]
            row = {"gpu": gpu, "tp": tp_group, "regime": regime, "points": len(sel)}
            for model in ("kernel", "roofline_old", "roofline_fit"):
                err = (sel[model] / sel["measured"] - 1).abs() * 100
                row[f"{model}_median"] = err.median()
                row[f"{model}_max"] = err.max()
            rows.append(row)
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vidur", type=Path, default=ROOT.parent / "shared" / "data" / "vidur")
    parser.add_argument("--csv", type=Path, help="Write every prediction here.")
    parser.add_argument(
        "--no-throttle", action="store_true", help="fit the kernel model without the power cap"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    results = pd.concat(
        [
            lomo(read_tables(args.vidur, gpu), hw, throttle=not args.no_throttle)
            for gpu, hw in VIDUR_GPUS.items()
        ],
        ignore_index=True,
    )
    if args.csv:
        results.to_csv(args.csv, index=False)
    summary = summarize(results)
    table = Table(title="Leave-one-model-out, non-attention step time, |error| % median / max")
    for column in (
        "GPU",
        "TP",
        "tokens",
        "points",
        "kernel model",
        "roofline 0.6/0.8",
        "roofline, fitted",
    ):
        table.add_column(column, no_wrap=True)
    for row in summary.itertuples():
        table.add_row(
            row.gpu,
            row.tp,
            row.regime.split()[1],
            str(row.points),
            f"{row.kernel_median:.1f} / {row.kernel_max:.1f}",
            f"{row.roofline_old_median:.1f} / {row.roofline_old_max:.1f}",
            f"{row.roofline_fit_median:.1f} / {row.roofline_fit_max:.1f}",
        )
    console = Console()
    console.print(table)
    per_model = results.assign(err=(results["kernel"] / results["measured"] - 1).abs() * 100)
    console.print(
        per_model.groupby(["gpu", "model", "num_tensor_parallel_workers"])["err"]
        .agg(["median", "max"])
        .round(1)
        .to_string()
    )
    console.print(f"[dim]{time.perf_counter() - start:.0f} s[/dim]")


if __name__ == "__main__":
    main()
