"""The calibration profile fitted to step times measured by ``validate/gpu_measure.py``.

``validate/gpu_measure.py`` (torch only: it and ``validate/gpu_stack.py`` are what to copy onto a
GPU box) times the steps of a random-weight decoder stack and writes a raw JSON file. Here,
where kvsim is installed::

    python -m validate.gpu_profile merge run1.json run2.json -o raw.json
    python -m validate.gpu_profile fit raw.json -o validate/profiles/h200-llama-3.1-8b.json
    python -m validate.gpu_profile compare raw.json --profile validate/profiles/....json

``merge`` keeps per batch shape the first run's time unless another was faster by more than
:data:`MERGE_MARGIN`; ``fit`` turns the measured steps into a
:class:`sim.config.calibration.CalibrationProfile` with :func:`validate.fit.fit_cost_params`;
``compare`` prints, point by point, how far the datasheet roofline (default CostParams) and
the fitted profile are from the measurements. ``measure`` runs ``validate/gpu_measure.py``
(``python3 validate/gpu_profile.py measure --out raw.json`` works as before, with
gpu_measure.py and gpu_stack.py beside it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

try:
    from validate import gpu_measure
except ImportError:  # run as a file (validate/ not importable as a package): its sibling
    import gpu_measure

RAW_FORMAT = gpu_measure.RAW_FORMAT

# Everything below imports sim lazily, so that ``measure`` runs where only torch is.

_STEP_FIELDS = (
    "num_prefill_tokens",
    "num_prefill_reqs",
    "prefill_attention_pairs",
    "num_decode_reqs",
    "decode_context_tokens",
    "median_s",
)


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read and check a raw file written by ``measure``; errors name the file and field."""
    from sim.errors import KvsimConfigError

    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvsimConfigError(f"cannot read raw GPU measurements {path}: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != RAW_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise KvsimConfigError(
            f"{path}: format={found!r}, expected {RAW_FORMAT!r}; give the JSON that "
            "`python3 validate/gpu_profile.py measure --out FILE` wrote"
        )
    for key in ("geometry", "environment", "micro", "steps"):
        if key not in raw:
            raise KvsimConfigError(f"{path}: field {key!r} is missing")
    steps = raw["steps"]
    if not isinstance(steps, list) or not steps:
        raise KvsimConfigError(f"{path}: steps is empty; the measure run timed no step")
    for i, step in enumerate(steps):
        for key in _STEP_FIELDS:
            value = step.get(key) if isinstance(step, dict) else None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise KvsimConfigError(f"{path}: steps[{i}].{key}={value!r}; must be a number >= 0")
        if not step["median_s"] > 0:
            raise KvsimConfigError(f"{path}: steps[{i}].median_s={step['median_s']!r}; must be > 0")
    return raw


# A later run's step replaces an earlier one's only when faster by more than this: identical
# kernels measured in two runs on the H200 differed by up to ~8% (median 0.3%).
MERGE_MARGIN = 0.05


def merge_raws(raws: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One raw record from runs of the same geometry on the same device (e.g. with
    ``--split-kv off`` and ``--split-kv always``): per batch shape the first run's step,
    unless a later run measured it more than ``MERGE_MARGIN`` faster, since the fastest
    kernel torch offers for a shape is what an engine would run. Each step keeps its
    ``run`` and every run's ``median_s_by_run``; ``micro`` and ``environment`` come from
    the first run, all runs' in ``merged_from``."""
    from sim.errors import KvsimConfigError

    if len(raws) < 2:
        raise KvsimConfigError(f"merge needs at least two raw files, got {len(raws)}")
    first_name, first = raws[0]
    ident = (first["geometry"].get("name"), first["environment"].get("device_name"))
    for name, raw in raws[1:]:
        other = (raw["geometry"].get("name"), raw["environment"].get("device_name"))
        if other != ident:
            raise KvsimConfigError(
                f"{name}: geometry/device {other} differs from {first_name}'s {ident}; "
                "merge only runs of one model on one device"
            )
    by_shape: dict[tuple[float, ...], dict[str, Any]] = {}
    for run, (_, raw) in enumerate(raws):
        for step in raw["steps"]:
            key = tuple(float(step[k]) for k in _STEP_FIELDS[:-1])
            kept = by_shape.get(key)
            if kept is None:
                by_shape[key] = {**step, "run": run, "median_s_by_run": [None] * len(raws)}
            elif step["median_s"] < (1.0 - MERGE_MARGIN) * kept["median_s"]:
                by_shape[key] = {**step, "run": run, "median_s_by_run": kept["median_s_by_run"]}
            by_shape[key]["median_s_by_run"][run] = step["median_s"]
    merged = {k: v for k, v in first.items() if k not in ("steps", "skipped", "failed")}
    merged["steps"] = list(by_shape.values())
    merged["skipped"] = first.get("skipped", [])
    merged["failed"] = [f for _, raw in raws for f in raw.get("failed", [])]
    merged["merge_rule"] = (
        f"per batch shape the first run's median, unless a later run's was more than "
        f"{100 * MERGE_MARGIN:.0f}% faster"
    )
    merged["merged_from"] = [
        {
            "file": name,
            "attention": raw.get("attention", {}),
            "micro": raw["micro"],
            "environment": raw["environment"],
            "steps": len(raw["steps"]),
            "steps_kept": sum(1 for s in merged["steps"] if s["run"] == run),
        }
        for run, (name, raw) in enumerate(raws)
    ]
    return merged


def raw_model(raw: dict[str, Any]):  # -> ModelGeometry
    """The kvsim model preset of the measured geometry, or an inline geometry for others."""
    from sim.config.model import MODEL_PRESETS, ModelGeometry

    g = raw["geometry"]
    preset = MODEL_PRESETS.get(str(g.get("name")))
    if preset is not None:
        return preset
    fields = set(ModelGeometry.model_fields)
    return ModelGeometry.model_validate({k: v for k, v in g.items() if k in fields})


def raw_shapes(raw: dict[str, Any]):  # -> tuple[list[BatchShape], list[float]]
    from sim.scheduler.output import BatchShape

    shapes = [
        BatchShape(
            num_prefill_tokens=int(s["num_prefill_tokens"]),
            num_prefill_reqs=int(s["num_prefill_reqs"]),
            prefill_attention_pairs=float(s["prefill_attention_pairs"]),
            num_decode_reqs=int(s["num_decode_reqs"]),
            decode_context_tokens=int(s["decode_context_tokens"]),
        )
        for s in raw["steps"]
    ]
    return shapes, [float(s["median_s"]) for s in raw["steps"]]


def fit_profile(raw: dict[str, Any], hardware: str, command: str):  # -> CalibrationProfile
    """A CalibrationProfile fitted to the measured steps (relative error, prefill-bearing and
    decode-only steps each carrying half of the loss, as ``kvsim calibrate`` weighs them).

    ``kv_transfer_efficiency`` (what swap and CPU offload move blocks at) is the measured
    pinned host<->device bandwidth, the slower direction, over the preset's PCIe figure;
    without a host measurement (a CPU run) it keeps its default."""
    from sim.config.calibration import CalibrationProfile
    from sim.config.hardware import resolve_hardware
    from sim.cost_model import CostParams
    from validate.fit import fit_cost_params

    model = raw_model(raw)
    hw = resolve_hardware(hardware)
    shapes, durations = raw_shapes(raw)
    has_prefill = [s.num_prefill_reqs > 0 for s in shapes]
    num_prefill = max(sum(has_prefill), 1)
    num_decode = max(len(shapes) - sum(has_prefill), 1)
    weights = [0.5 / num_prefill if p else 0.5 / num_decode for p in has_prefill]
    micro = {str(k): float(v) for k, v in raw["micro"].items()}
    base = CostParams()
    host_bw = [micro[k] for k in ("h2d_pinned_bytes_per_s", "d2h_pinned_bytes_per_s") if k in micro]
    if host_bw:
        efficiency = min(host_bw) / hw.pcie_bandwidth_bytes_per_s
        base = CostParams(kv_transfer_efficiency=efficiency)
    params, fit = fit_cost_params(
        shapes, durations, model, hw, 1, base=base, relative=True, weights=weights
    )
    env = {str(k): str(v) for k, v in raw["environment"].items()}
    env["attention"] = str(raw.get("attention", {}).get("path", "?"))
    env["timing"] = "cuda graphs" if raw.get("timing", {}).get("cuda_graphs") else "eager"
    return CalibrationProfile(
        params=params,
        # The preset it prices (what `kvsim run` compares with the scenario's hardware);
        # the GPU's own name stays in the environment (device_name).
        hardware=hw.name,
        model=model.name,
        vllm_version=f"none (torch {env.get('torch', '?')} kernels, no vLLM)",
        tensor_parallel_size=1,
        fit=fit,
        num_steps=int(fit["num_steps"]),
        created_by=command,
        source="torch-kernels",
        environment=env,
        device_measurements=micro,
    )


def compare_rows(raw: dict[str, Any], hardware: str, profile=None) -> list[dict[str, Any]]:
    """Per measured step: measured, roofline-preset and (with ``profile``) fitted seconds."""
    from sim.config.hardware import resolve_hardware
    from sim.cost_model import CostModel, CostParams

    model = raw_model(raw)
    hw = resolve_hardware(hardware)
    roofline = CostModel(model, hw, 1, CostParams())
    fitted = CostModel(model, hw, 1, profile.params) if profile is not None else None
    shapes, durations = raw_shapes(raw)
    rows = []
    for step, shape, measured_s in zip(raw["steps"], shapes, durations, strict=True):
        row = {
            "regime": step.get("regime", "?"),
            "point": _point_label(step),
            "measured_s": measured_s,
            "roofline_s": roofline.step_time_s(shape),
        }
        row["roofline_err_pct"] = 100.0 * (row["roofline_s"] / measured_s - 1.0)
        if fitted is not None:
            row["fitted_s"] = fitted.step_time_s(shape)
            row["fitted_err_pct"] = 100.0 * (row["fitted_s"] / measured_s - 1.0)
        rows.append(row)
    return rows


def _point_label(step: dict[str, Any]) -> str:
    parts = []
    if step.get("num_prefill_reqs"):
        n = step["num_prefill_reqs"]
        chunk = step.get("chunk_tokens", step["num_prefill_tokens"] // n)
        reqs = f"{n}x" if n > 1 else ""
        parts.append(f"prefill {reqs}{chunk} @ctx {step.get('prefill_context_tokens', '?')}")
    if step.get("num_decode_reqs"):
        n = step["num_decode_reqs"]
        ctx = step.get("decode_context_tokens", 0) // max(n, 1)
        parts.append(f"decode {n} @ctx {ctx}")
    return " + ".join(parts)


def regime_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per regime: mean absolute and median signed error (%) of the roofline and the fit."""
    out: dict[str, dict[str, float]] = {}
    for regime in sorted({r["regime"] for r in rows}):
        sel = [r for r in rows if r["regime"] == regime]
        summary = {"points": float(len(sel))}
        for key in ("roofline", "fitted"):
            errs = [r[f"{key}_err_pct"] for r in sel if f"{key}_err_pct" in r]
            if errs:
                summary[f"{key}_mean_abs_pct"] = statistics.fmean(abs(e) for e in errs)
                summary[f"{key}_median_pct"] = statistics.median(errs)
        out[regime] = summary
    return out


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    has_fit = any("fitted_s" in r for r in rows)
    head = ["regime", "point", "measured ms", "roofline ms", "roofline err"]
    if has_fit:
        head += ["fitted ms", "fitted err"]
    lines = []
    for r in rows:
        cells = [
            r["regime"],
            r["point"],
            f"{1e3 * r['measured_s']:.2f}",
            f"{1e3 * r['roofline_s']:.2f}",
            f"{r['roofline_err_pct']:+.0f}%",
        ]
        if has_fit:
            cells += [f"{1e3 * r['fitted_s']:.2f}", f"{r['fitted_err_pct']:+.0f}%"]
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c) + " |" for c in lines]
        return "\n".join(out)
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([fmt(head), *(fmt(c) for c in lines)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m validate.gpu_profile", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "measure",
        help="time steps of a random-weight decoder stack (validate/gpu_measure.py; "
        "its options follow)",
        add_help=False,
    )
    f = sub.add_parser("fit", help="fit a kvsim calibration profile to a raw file")
    f.add_argument("raw", type=Path)
    f.add_argument("-o", "--out", required=True, type=Path, help="profile JSON to write")
    f.add_argument("--hardware", default="H200-141GB", help="kvsim hardware preset")
    mg = sub.add_parser("merge", help="keep per batch shape the fastest of several raw runs")
    mg.add_argument("raws", type=Path, nargs="+", help="raw files, the reference run first")
    mg.add_argument("-o", "--out", required=True, type=Path, help="merged raw JSON to write")
    c = sub.add_parser("compare", help="roofline preset (and a profile) vs the measurements")
    c.add_argument("raw", type=Path)
    c.add_argument("--profile", type=Path, help="fitted profile to compare as well")
    c.add_argument("--hardware", default="H200-141GB", help="kvsim hardware preset")
    c.add_argument("--markdown", action="store_true", help="print a Markdown table")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["measure"]:
        return gpu_measure.main(argv[1:])
    args = parser.parse_args(argv)
    from sim.errors import KvsimConfigError

    try:
        if args.command == "merge":
            merged = merge_raws([(p.name, load_raw(p)) for p in args.raws])
            gpu_measure.write_json(args.out, merged)
            kept = ", ".join(f"{m['file']}: {m['steps_kept']}" for m in merged["merged_from"])
            print(f"merged {len(merged['steps'])} steps ({kept}) -> {args.out}")
            return 0
        raw = load_raw(args.raw)
        if args.command == "fit":
            from sim.config.calibration import save_profile

            command = f"python -m validate.gpu_profile fit {args.raw} --hardware {args.hardware}"
            profile = fit_profile(raw, args.hardware, command)
            save_profile(profile, args.out)
            fit = profile.fit
            print(
                f"fitted {profile.num_steps} steps of {profile.model} on {profile.hardware}: "
                f"r2 {fit['r2']:.4f}, MAPE {fit['mape']:.1f}%, max {fit['max_abs_pct_error']:.0f}%"
                f" -> {args.out}"
            )
            return 0
        from sim.config.calibration import load_profile

        profile = load_profile(args.profile) if args.profile else None
        rows = compare_rows(raw, args.hardware, profile)
        print(format_table(rows, args.markdown))
        print()
        for regime, s in regime_summary(rows).items():
            print(f"{regime}: " + ", ".join(f"{k} {v:.1f}" for k, v in s.items()))
        return 0
    except KvsimConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
