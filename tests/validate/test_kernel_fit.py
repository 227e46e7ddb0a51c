"""Fitting GPU kernel parameters on Vidur-format operator tables (kvsim calibrate --vidur)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.config.calibration import KERNEL_FIT_FILES, KERNEL_FITS_DIR, load_profile
from sim.config.hardware import resolve_hardware
from sim.errors import KvsimConfigError
from sim.gpu_kernels import GemmFit, gemm_time_s
from validate.kernel_fit import (
    _cell_weights,
    fit_gemm,
    fit_kernel_params,
    fit_roofline,
    measured_layer_s,
    predicted_layer_s,
    roofline_layer_s,
)
from validate.vidur_profile import SOURCE, TORCH_SOURCE, table_provenance, vidur_profile
from validate.vidur_tables import OperatorTables, read_tables

VIDUR = Path(__file__).parent / "data" / "vidur"
H100 = resolve_hardware("H100-SXM-80GB")
runner = CliRunner()


def test_tables_are_read_tidy_with_duplicates_reduced_to_their_median() -> None:
    tables = read_tables(VIDUR, "h100")
    assert tables.models == ["CodeLlama-34b-Instruct-hf", "Llama-2-7b-hf", "phi-2"]
    layers = tables.layers
    # 2048 and 4096 tokens were measured twice per TP degree in the original table.
    assert not layers.duplicated(["model", "num_tokens", "num_tensor_parallel_workers"]).any()
    phi = layers[layers["model"] == "phi-2"]
    assert phi["post_attention_layernorm"].isna().all()  # parallel attention + MLP
    assert (layers["attn_pre_proj"] > 0).all() and (layers["attn_pre_proj"] < 1e-2).all()
    assert set(tables.allreduce["tensor_parallel_size"]) == {2}


def test_bad_folders_and_tables_are_one_message(tmp_path: Path) -> None:
    with pytest.raises(KvsimConfigError, match="no compute/ folder"):
        read_tables(tmp_path, "h100")
    with pytest.raises(KvsimConfigError, match="nowhere: no such folder"):
        read_tables(tmp_path / "nowhere", "h100")
    with pytest.raises(KvsimConfigError, match="GPUs there: h100"):
        read_tables(VIDUR, "b200")
    bad = tmp_path / "compute" / "h100" / "org" / "model"
    bad.mkdir(parents=True)
    (bad / "mlp.csv").write_text("num_tokens,n_head\n1,32\n")
    with pytest.raises(KvsimConfigError, match="lacks column"):
        read_tables(tmp_path, "h100")


def test_the_gemm_fit_recovers_the_parameters_that_generated_the_times() -> None:
    truth = GemmFit(
        floor_s=4e-6,
        compute_efficiency=0.7,
        bandwidth_efficiency=0.85,
        full_ctas_per_sm=1.5,
        occupancy_exponent=0.6,
        overlap_exponent=3.0,
        tile_bandwidth_factor=8.0,
    )
    rng = np.random.default_rng(0)
    m = rng.choice([1, 8, 64, 128, 136, 256, 512, 1024, 4096], 400).astype(float)
    k = rng.choice([2560, 4096, 8192, 11008], 400).astype(float)
    n = rng.choice([1024, 4096, 12288, 22016], 400).astype(float)
    time_s = gemm_time_s(m, k, n, truth, 132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s)
    fitted = fit_gemm(pd.DataFrame({"m": m, "k": k, "n": n, "time_s": time_s}), H100)
    predicted = gemm_time_s(
        m, k, n, fitted, 132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s
    )
    assert np.abs(predicted / time_s - 1).max() < 0.01
    assert fitted.compute_efficiency == pytest.approx(0.7, rel=0.05)
    assert fitted.floor_s == pytest.approx(4e-6, rel=0.1)


def test_the_gemm_fit_recovers_a_power_cap_throttle() -> None:
    """Times generated with a throttle (long compute-bound GEMMs 12% slower per FLOP) are
    fitted back to it: the fit tells the throttle from a lower compute efficiency because
    short compute-bound GEMMs are not slowed."""
    truth = GemmFit(
        floor_s=4e-6,
        compute_efficiency=0.8,
        bandwidth_efficiency=0.85,
        full_ctas_per_sm=1.5,
        occupancy_exponent=0.6,
        overlap_exponent=3.0,
        tile_bandwidth_factor=8.0,
        throttle_slowdown=0.12,
        throttle_time_s=5e-4,
    )
    rng = np.random.default_rng(1)
    m = rng.choice([1, 8, 64, 128, 256, 512, 1024, 2048, 4096], 500).astype(float)
    k = rng.choice([2560, 4096, 8192, 11008, 24576], 500).astype(float)
    n = rng.choice([2560, 4096, 12288, 22016, 49152], 500).astype(float)
    hw = (132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s)
    time_s = gemm_time_s(m, k, n, truth, *hw)
    fitted = fit_gemm(pd.DataFrame({"m": m, "k": k, "n": n, "time_s": time_s}), H100)
    assert np.abs(gemm_time_s(m, k, n, fitted, *hw) / time_s - 1).max() < 0.01
    assert fitted.throttle_slowdown == pytest.approx(0.12, rel=0.25)
    assert fitted.compute_efficiency == pytest.approx(0.8, rel=0.05)


def test_the_shipped_fits_have_the_power_cap() -> None:
    """The shipped H100 and A100 fits were fitted with the power-cap term (their created_by
    has no --no-power-cap); --no-power-cap fits with the term held at zero."""
    for gpu, preset in (("h100", "H100-SXM-80GB"), ("a100", "A100-80GB")):
        shipped = load_profile(KERNEL_FITS_DIR / KERNEL_FIT_FILES[preset])
        assert shipped.created_by == f"kvsim calibrate --vidur ../shared/data/vidur --gpu {gpu}"
        assert shipped.params.kernels is not None
        assert 0.1 < shipped.params.kernels.gemm.throttle_slowdown < 1.0
    without = vidur_profile(VIDUR, "h100", power_cap=False)
    assert without.created_by == f"kvsim calibrate --vidur {VIDUR} --gpu h100 --no-power-cap"
    assert without.params.kernels is not None
    assert without.params.kernels.gemm.throttle_slowdown == 0.0


def test_a_model_left_out_of_the_fit_is_predicted_from_its_shapes() -> None:
    tables = read_tables(VIDUR, "h100")
    held = "Llama-2-7b-hf"
    train = OperatorTables("h100", tables.layers[tables.layers["model"] != held], tables.allreduce)
    test = tables.layers[tables.layers["model"] == held]
    params = fit_kernel_params(train, H100)
    measured = measured_layer_s(test)
    error = np.abs(predicted_layer_s(test, params, H100) / measured - 1)
    roofline_error = np.abs(roofline_layer_s(test, H100, 0.6, 0.8) / measured - 1)
    assert np.median(error) < 0.08 and error.max() < 0.35
    assert np.median(error) < np.median(roofline_error)
    compute, bandwidth = fit_roofline(train.layers, H100)
    assert 0.2 < compute <= 1 and 0.2 < bandwidth <= 1


def test_calibrate_vidur_writes_a_profile_that_runs(tmp_path: Path) -> None:
    out = tmp_path / "h100.json"
    result = runner.invoke(
        app, ["calibrate", "--vidur", str(VIDUR), "--gpu", "h100", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "fitted kernel parameters of H100-SXM-80GB" in result.output
    assert "power cap: sustained compute" in result.output
    profile = load_profile(out)
    assert profile.source == "vidur-operator-tables" and profile.params.mode == "operators"
    assert profile.params.kernels is not None
    assert [f.tensor_parallel_size for f in profile.params.kernels.allreduce] == [2]
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "run",
            "scenarios/chat-rag-baseline.yaml",
            "--calibration",
            str(out),
            "--set",
            "workload.num_requests=30",
            "--out",
            str(run_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["calibration"]["source"] == "vidur-operator-tables"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "h100"], "either run directories or --vidur"),
        (["--vidur", str(VIDUR), "--gpu", "tpu"], "GPUs there: h100"),
        (["--vidur", str(VIDUR), "--gpu", "h100", "--hardware", "nope"], "not a preset"),
        (["runs/x", "--gpu", "a100"], "--gpu, --hardware and --no-power-cap only apply with"),
        (["runs/x", "--no-power-cap"], "--gpu, --hardware and --no-power-cap only apply with"),
    ],
)
def test_calibrate_vidur_refuses_bad_arguments(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = runner.invoke(app, ["calibrate", *args, "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("n_head", 0, "column n_head, row 2: 0 is not a positive integer"),
        ("num_tensor_parallel_workers", "abc", "'abc' is not a positive integer"),
        ("time_stats.mlp_act.median", -1.0, "-1.0 is not a positive, finite time in ms"),
        ("time_stats.attn_pre_proj.median", None, "attn_pre_proj.median has empty cells"),
    ],
)
def test_bad_values_in_a_table_name_file_column_and_row(
    tmp_path: Path, column: str, value: object, message: str
) -> None:
    src = VIDUR / "compute" / "h100" / "meta-llama" / "Llama-2-7b-hf" / "mlp.csv"
    dst = tmp_path / "compute" / "h100" / "meta-llama" / "Llama-2-7b-hf" / "mlp.csv"
    dst.parent.mkdir(parents=True)
    frame = pd.read_csv(src)
    frame[column] = frame[column].astype(object)
    frame.loc[0, column] = value
    frame.to_csv(dst, index=False)
    with pytest.raises(KvsimConfigError) as error:
        read_tables(tmp_path, "h100")
    assert message in str(error.value) and str(dst) in str(error.value)


def test_calibrate_warns_about_other_hardware_and_missing_allreduce(tmp_path: Path) -> None:
    compute_only = tmp_path / "vidur"
    (compute_only / "compute").mkdir(parents=True)
    for model in ("meta-llama", "codellama"):
        src = VIDUR / "compute" / "h100" / model
        dst = compute_only / "compute" / "h100" / model
        dst.mkdir(parents=True)
        for path in src.rglob("mlp.csv"):
            target = dst / path.parent.name
            target.mkdir()
            (target / "mlp.csv").write_text(path.read_text())
    out = tmp_path / "p.json"
    result = runner.invoke(
        app,
        [
            "calibrate",
            "--vidur",
            str(compute_only),
            "--gpu",
            "h100",
            "--hardware",
            "H200-141GB",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "--hardware H200-141GB is not H100-SXM-80GB" in text
    assert "no network/h100_dgx/all_reduce.csv measurements" in text
    assert load_profile(out).params.kernels.allreduce == []


def test_each_tp_degree_and_regime_weighs_the_same_in_the_gemm_fit() -> None:
    layers = pd.DataFrame(
        {
            "num_tokens": [1, 2, 4, 300, 512, 1024, 2048, 4096, 8192, 1],
            "num_tensor_parallel_workers": [1, 1, 1, 1, 1, 1, 1, 1, 1, 2],
        }
    )
    weights = _cell_weights(layers)
    # cells: TP1 decode (3 rows), TP1 257-511 (1), TP1 prefill (4), TP1 beyond (1), TP2 decode (1)
    cells = [[0, 1, 2], [3], [4, 5, 6, 7], [8], [9]]
    weight_of_cell = [float(np.sum(weights[rows] ** 2)) for rows in cells]
    assert weight_of_cell == pytest.approx([weight_of_cell[0]] * 5)
    assert np.mean(weights**2) == pytest.approx(1.0)


PROFILES = Path(__file__).resolve().parents[2] / "validate" / "profiles"


def test_tables_measured_with_torch_are_named_by_their_meta(tmp_path: Path) -> None:
    """validate/gpu_operators.py writes meta.json beside compute/: a profile fitted on such
    tables says they are torch kernels on that device, not Vidur's."""
    assert table_provenance(tmp_path) == (SOURCE, "n/a (operator kernels, not vLLM)", {})
    (tmp_path / "meta.json").write_text("{not json")
    assert table_provenance(tmp_path)[0] == SOURCE
    meta = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "elementwise": "compiled"}
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "cuda": None, "done": []}))
    source, version, environment = table_provenance(tmp_path)
    assert source == TORCH_SOURCE == "torch-operator-tables"
    assert version == "none (torch 2.11.0+cu130 kernels, not vLLM)"
    assert environment == meta


def test_the_shipped_h200_fit_is_the_fit_of_the_committed_h200_tables() -> None:
    """sim/config/kernel_fits/h200-141gb.json (the H200 preset's step times) was written by
    the command in its created_by on validate/profiles/h200-operators: it prices those tables
    with the errors it records (a refit takes a minute; this checks the pairing)."""
    profile = load_profile(KERNEL_FITS_DIR / KERNEL_FIT_FILES["H200-141GB"])
    assert profile.created_by == (
        "kvsim calibrate --vidur validate/profiles/h200-operators --gpu h200 --hardware H200-141GB"
    )
    assert (profile.source, profile.hardware) == ("torch-operator-tables", "H200-141GB")
    assert profile.environment["device"] == "NVIDIA H200"
    layers = read_tables(PROFILES / "h200-operators", "h200").layers
    assert sorted(layers["model"].unique()) == [
        "CodeLlama-34b-Instruct-hf",
        "Llama-2-7b-hf",
        "Llama-3.1-8B",
        "Meta-Llama-3-70B",
        "Qwen-72B",
        "phi-2",
    ]
    assert profile.params.kernels is not None
    predicted = predicted_layer_s(layers, profile.params.kernels, resolve_hardware("H200-141GB"))
    error = np.abs(predicted / measured_layer_s(layers) - 1) * 100
    assert profile.num_steps == len(layers) == 4767
    assert np.median(error) == pytest.approx(profile.fit["median_abs_pct_error"], rel=1e-9)
    assert error.max() == pytest.approx(profile.fit["max_abs_pct_error"], rel=1e-9)
