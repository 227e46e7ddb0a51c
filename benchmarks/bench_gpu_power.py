"""The power cap on a GPU, measured: how far and how soon sustained GEMMs slow down.

Reads what ``validate/gpu_power.py`` measured on one NVIDIA H200
(``validate/profiles/h200-power/power.json``; ``nvidia-smi.csv.gz`` beside it holds the SM
clock, the 1 s board power and the throttle reasons sampled every 50 ms during the run) and
prints:

- the sag chains: one GEMM run back to back after an idle pause, each kernel timed; the kernel
  time at full clock (the kernels after the first, in the first 20 ms), once throttled (the last
  half of the chain), and the compute time after which the kernels run 5% slower (onset);
- single GEMMs of growing length: TFLOP/s started after an idle pause and once sustained;
- what the operator tables show at 2048-4096 tokens per step: the GEMMs' TFLOP/s per model at
  TP1, in Vidur's H100 tables and in the H200 tables measured here.

    python benchmarks/bench_gpu_power.py [--vidur ../shared/data/vidur]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from validate.kernel_fit import gemm_samples  # noqa: E402
from validate.vidur_tables import read_tables  # noqa: E402

POWER = ROOT / "validate" / "profiles" / "h200-power" / "power.json"
H200_TABLES = ROOT / "validate" / "profiles" / "h200-operators"
FULL_CLOCK_WINDOW_S = 0.020  # kernels in the first 20 ms of a chain run at full clock
ONSET_SLOWDOWN = 1.05  # a kernel 5% slower than full clock has been throttled


def sag(chain: dict) -> dict[str, float]:
    """Full-clock and throttled kernel time of a chain and the compute time at onset."""
    times = np.asarray(chain["times_s"])
    before = np.concatenate([[0.0], np.cumsum(times)[:-1]])  # compute done before each kernel
    early = times[1:][before[1:] < FULL_CLOCK_WINDOW_S]
    full = float(np.median(early if early.size else times[1:2]))
    throttled = float(np.median(times[len(times) // 2 :]))
    slow = np.flatnonzero(times[1:] > ONSET_SLOWDOWN * full) + 1
    onset = float(before[slow[0]]) if slow.size else float("nan")
    return {"full_s": full, "throttled_s": throttled, "onset_s": onset, "run_s": float(times.sum())}


def table_tflops(tables_root: Path, gpu: str) -> dict[str, float]:
    """Per model, the median TFLOP/s of its TP1 GEMMs at 2048-4096 tokens per step."""
    layers = read_tables(tables_root, gpu).layers
    layers = layers[
        (layers["num_tensor_parallel_workers"] == 1) & layers["num_tokens"].between(2048, 4096)
    ].reset_index(drop=True)
    gemms = gemm_samples(layers)
    tflops = 2.0 * gemms["m"] * gemms["k"] * gemms["n"] / gemms["time_s"] / 1e12
    models = layers["model"].to_numpy()[gemms["row"].to_numpy()]
    return tflops.groupby(models).median().sort_index().to_dict()


def table(title: str, columns: tuple[str, ...]) -> Table:
    """A rich table with right-aligned ``columns``."""
    out = Table(title=title)
    for column in columns:
        out.add_column(column, justify="right")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vidur", type=Path, default=ROOT.parent / "shared" / "data" / "vidur")
    args = parser.parse_args()
    console = Console(width=150)
    data = json.loads(POWER.read_text())
    console.print(
        f"{data['device']}, torch {data['torch']}, CUDA {data['cuda']}; idle "
        f"{data['idle']['clock_mhz']} MHz, {data['idle']['power_w']} W; "
        f"{data['cool_s']} s idle before each start, median of {data['trials']} starts"
    )
    chains = table(
        "Sag chains: one GEMM back to back after an idle pause",
        (
            "GEMM (M x K -> N)",
            "kernels",
            "run ms",
            "full-clock ms",
            "throttled ms",
            "slower",
            "onset after (ms of compute)",
        ),
    )
    for chain in data["sag"]:
        result = sag(chain)
        chains.add_row(
            f"{chain['m']} x {chain['k']} -> {chain['n']}",
            str(len(chain["times_s"])),
            f"{result['run_s'] * 1e3:.0f}",
            f"{result['full_s'] * 1e3:.3f}",
            f"{result['throttled_s'] * 1e3:.3f}",
            f"{(result['throttled_s'] / result['full_s'] - 1) * 100:+.1f}%",
            f"{result['onset_s'] * 1e3:.0f}",
        )
    console.print(chains)
    lengths = table(
        "Single GEMMs: started after an idle pause vs sustained (TFLOP/s)",
        (
            "GEMM (K -> N)",
            "M",
            "ms started",
            "TFLOP/s started",
            "ms sustained",
            "TFLOP/s sustained",
            "SM MHz sustained",
        ),
    )
    for point in data["length"]:
        lengths.add_row(
            f"{point['shape']} ({point['k']} -> {point['n']})",
            str(point["m"]),
            f"{point['cool_s'] * 1e3:.3f}",
            f"{point['flops'] / point['cool_s'] / 1e12:.0f}",
            f"{point['sustained_s'] * 1e3:.3f}",
            f"{point['flops'] / point['sustained_s'] / 1e12:.0f}",
            f"{point['clock_mhz']:.0f}" if point["clock_mhz"] else "-",
        )
    console.print(lengths)
    tables = table(
        "Operator tables, TP1 GEMMs at 2048-4096 tokens: median TFLOP/s",
        ("tables", "model", "TFLOP/s"),
    )
    for name, root, gpu in (("Vidur H100", args.vidur, "h100"), ("H200 here", H200_TABLES, "h200")):
        for model, tflops in table_tflops(root, gpu).items():
            tables.add_row(name, model, f"{tflops:.0f}")
    console.print(tables)


if __name__ == "__main__":
    main()
