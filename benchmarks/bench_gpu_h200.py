"""The GPU kernel cost model on a GPU absent from Vidur's tables: H200 operators measured here.

``validate/profiles/h200-operators`` holds Vidur-format tables measured on one NVIDIA H200 with
``validate/gpu_operators.py`` (torch 2.11, CUDA 13's cuBLAS; the element-wise operators as
``torch.compile`` kernels, not vLLM's). This report prices their non-attention layer times
(no all-reduce: one GPU measured no network) with:

- the shipped H100 kernel fit on the H200 preset's datasheet figures: what ``kvsim run`` would
  give an H200 if it used the H100 fit (a GPU without measurements gets a prediction from the
  fitted parameters and its shapes);
- the datasheet roofline at the cost model's defaults (compute 0.6, bandwidth 0.8): what the
  H200 preset used before its own fit shipped;
- the kernel model fitted on the H200 tables, in-sample and leave-one-model-out (fit on the
  other models, predict the held-out one at every token count and TP degree it has).

Also: the two runs' GEMM times against each other (run 1 on another H200 machine the same hour),
the H200's GEMMs against the H100's in Vidur's tables (the models both measured), and how often
a layer's GEMMs jump by more than 10% (25%) from one token count to the next in each.

    python benchmarks/bench_gpu_h200.py [--vidur ../shared/data/vidur] [--quick]

``--quick`` skips the leave-one-model-out fits (six fits, ~4 minutes on 2 cores); the
in-sample figures price the tables with the shipped fit,
``sim/config/kernel_fits/h200-141gb.json``.
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

from sim.config.calibration import KERNEL_FIT_FILES, KERNEL_FITS_DIR, load_profile  # noqa: E402
from sim.config.hardware import resolve_hardware  # noqa: E402
from validate.kernel_fit import (  # noqa: E402
    fit_kernel_params,
    measured_layer_s,
    predicted_layer_s,
    roofline_layer_s,
)
from validate.vidur_tables import (  # noqa: E402
    ELEMENTWISE_OPS,
    EMBEDDING_OP,
    GEMM_OPS,
    OperatorTables,
    read_tables,
)

TABLES = ROOT / "validate" / "profiles" / "h200-operators"
H200_FIT = KERNEL_FITS_DIR / KERNEL_FIT_FILES["H200-141GB"]
H100_FIT = KERNEL_FITS_DIR / KERNEL_FIT_FILES["H100-SXM-80GB"]
CELLS = {"1-256": (1, 256), "257-511": (257, 511), "512-4096": (512, 4096)}
KEYS = ["model", "num_tokens", "num_tensor_parallel_workers"]


def _gemms_only(layers: pd.DataFrame) -> pd.DataFrame:
    """The rows without their element-wise columns: measured and predicted layer times become
    the sums of the four GEMMs."""
    return layers.drop(columns=[*ELEMENTWISE_OPS, EMBEDDING_OP], errors="ignore")


def errors(layers: pd.DataFrame, predicted: np.ndarray, what: str) -> pd.DataFrame:
    measured = measured_layer_s(layers)
    frame = layers[KEYS].copy()
    frame["error_pct"] = (predicted / measured - 1) * 100
    frame["what"] = what
    return frame


def table(frames: list[pd.DataFrame], title: str) -> Table:
    results = pd.concat(frames, ignore_index=True)
    out = Table(title=title)
    for column in ("TP", "tokens", "points", *dict.fromkeys(results["what"])):
        out.add_column(column, no_wrap=True)
    tp1 = results["num_tensor_parallel_workers"] == 1
    for group, sel_tp in (("1", tp1), ("2-8", ~tp1)):
        for cell, (lo, hi) in CELLS.items():
            sel = sel_tp & results["num_tokens"].between(lo, hi)
            cells = []
            for what in dict.fromkeys(results["what"]):
                err = results.loc[sel & (results["what"] == what), "error_pct"]
                cells.append(
                    f"{err.abs().median():.1f} / {err.abs().max():.1f} ({err.median():+.1f})"
                )
            points = int((sel & (results["what"] == results["what"].iloc[0])).sum())
            out.add_row(group, cell, str(points), *cells)
    return out


def steps(layers: pd.DataFrame) -> str:
    """How often a layer's four GEMMs together take over 10% (25%) longer at one token count
    than at the one before (8-4096 tokens: steps of 8 to 1024 tokens, of 32 beyond), and the
    largest such ratio."""
    ratios = []
    for _, group in layers.groupby(["model", "num_tensor_parallel_workers"]):
        group = group.sort_values("num_tokens")
        total = group[list(GEMM_OPS)].sum(axis=1).to_numpy()
        ratio = total[1:] / total[:-1]
        ratios.append(ratio[group["num_tokens"].to_numpy()[1:] >= 8])
    ratio = np.concatenate(ratios)
    return (
        f"{(ratio > 1.10).mean() * 100:.1f}% ({(ratio > 1.25).mean() * 100:.1f}%) of "
        f"{len(ratio)} steps, largest x{ratio.max():.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vidur", type=Path, default=ROOT.parent / "shared" / "data" / "vidur")
    parser.add_argument("--quick", action="store_true", help="no leave-one-model-out fits")
    args = parser.parse_args()
    console = Console(width=150)
    started = time.perf_counter()
    h200 = resolve_hardware("H200-141GB")
    tables = read_tables(TABLES, "h200")
    layers = tables.layers
    h100_fit = load_profile(H100_FIT).params.kernels
    assert h100_fit is not None

    run1 = pd.read_csv(TABLES / "run1-gemms.csv")
    both = layers.merge(run1, on=KEYS, suffixes=("", "_run1"))
    ratio = both[list(GEMM_OPS)].sum(axis=1) / (
        both[[f"{op}_run1" for op in GEMM_OPS]].sum(axis=1) * 1e-3
    )
    console.print(
        f"GEMMs of a layer, run 2 / run 1 ({len(both)} points): median {ratio.median():.3f}, "
        f"p5-p95 {ratio.quantile(0.05):.3f}-{ratio.quantile(0.95):.3f}, "
        f"min {ratio.min():.3f}, max {ratio.max():.3f}"
    )

    if (args.vidur / "compute" / "h100").is_dir():
        h100 = read_tables(args.vidur, "h100").layers
        shared = layers.merge(h100, on=KEYS, suffixes=("", "_h100"))
        regime = np.where(shared["num_tokens"] <= 256, "1-256", "other")
        regime = np.where(shared["num_tokens"] >= 512, "512-4096", regime)
        ratios = {
            op: (shared[op] / shared[f"{op}_h100"]).groupby(regime).median() for op in GEMM_OPS
        }
        console.print(
            f"H200 / H100 GEMM time, median over {shared['model'].nunique()} shared models:"
        )
        for op, by in ratios.items():
            console.print(f"  {op}: " + ", ".join(f"{k} {v:.2f}" for k, v in by.items()))
        both_measured = layers["model"].isin(h100["model"].unique())
        console.print(
            "A layer's GEMMs over 10% (25%) slower than at the token count before, the models "
            f"both measured: H100 (Vidur) {steps(h100)}; H200 {steps(layers[both_measured])}"
        )
    console.print(f"The same, every H200 model: {steps(layers)}")

    gemms = _gemms_only(layers)
    transfer = [
        errors(layers, predicted_layer_s(layers, h100_fit, h200), "H100 fit, layer"),
        errors(gemms, predicted_layer_s(gemms, h100_fit, h200), "H100 fit, GEMMs"),
        errors(layers, roofline_layer_s(layers, h200, 0.6, 0.8), "roofline, layer"),
    ]
    console.print(
        table(transfer, "H200 tables priced without them: |error| % median / max (signed median)")
    )

    if args.quick:
        console.print(f"[dim]{time.perf_counter() - started:.0f} s (--quick)[/dim]")
        return
    # In-sample: the committed opt-in profile is this fit (tests/validate/test_kernel_fit.py).
    fitted = load_profile(H200_FIT).params.kernels
    assert fitted is not None
    own = [errors(layers, predicted_layer_s(layers, fitted, h200), "H200 fit, in-sample")]
    held_out = []
    for model in tables.models:
        train = OperatorTables("h200", layers[layers["model"] != model], tables.allreduce)
        test = layers[layers["model"] == model].reset_index(drop=True)
        params = fit_kernel_params(train, h200)
        held_out.append(errors(test, predicted_layer_s(test, params, h200), "H200 fit, held out"))
    own.append(pd.concat(held_out, ignore_index=True))
    console.print(table(own, "H200 tables, kernel model fitted on them: |error| % median / max"))
    per_model = own[1].assign(
        abs_error=own[1]["error_pct"].abs(),
        tp=np.where(own[1]["num_tensor_parallel_workers"] > 1, "TP2-8", "TP1"),
    )
    console.print("Held out, per model: |error| % median and max")
    console.print(
        per_model.groupby(["model", "tp"])["abs_error"].agg(["median", "max"]).round(1).to_string()
    )
    console.print(f"[dim]{time.perf_counter() - started:.0f} s[/dim]")


if __name__ == "__main__":
    main()
