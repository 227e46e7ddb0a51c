"""Calibration profiles: schema, save/load, and loading files written before the split."""

import json

import pytest

from sim.config.calibration import CalibrationProfile, load_profile, save_profile
from sim.cost_model import CostParams
from sim.errors import KvsimConfigError

TRUE_PARAMS = CostParams(
    mode="additive",
    compute_efficiency=0.55,
    attention_compute_efficiency=0.35,
    bandwidth_efficiency=0.75,
    step_overhead_s=2e-3,
    per_token_overhead_s=0.0,
    per_request_overhead_s=2e-5,
    prefill_step_overhead_s=4e-4,
    idle_wakeup_s=3e-3,
    post_prefill_decode_s=8e-4,
    allreduce_latency_s=0.0,
)


def make_profile() -> CalibrationProfile:
    return CalibrationProfile(
        params=TRUE_PARAMS,
        hardware="H100-SXM-80GB",
        model="Llama-3.1-8B",
        vllm_version="0.33.0",
        fit={"r2": 0.98, "mape": 4.2, "max_abs_pct_error": 17.0},
        num_steps=1234,
        created_by="kvsim calibrate runs/h100",
    )


def test_profile_save_load_roundtrip(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(make_profile(), path)
    assert load_profile(path) == make_profile()


def test_budget_warning_names_the_field_and_the_calibrated_budgets():
    old = make_profile()  # written before profiles recorded their budgets: no claim either way
    assert old.max_num_batched_tokens == [] and old.budget_warning(384) is None
    assert old.model_copy(update={"max_num_batched_tokens": [512]}).budget_warning(512) is None
    # Runs at two budgets and no fit of each: the fit over both prices either (a warning).
    profile = old.model_copy(update={"max_num_batched_tokens": [512, 2048]})
    assert "no fit of its own" in (profile.budget_warning(512) or "")
    assert "no fit of its own" in (profile.budget_warning(2048) or "")
    warning = profile.budget_warning(384)
    assert warning is not None
    assert "engine.max_num_batched_tokens=384" in warning and "512, 2048" in warning


def test_a_profile_over_several_budgets_prices_each_by_its_own_fit():
    pooled, at_2048 = CostParams(step_overhead_s=1e-3), CostParams(step_overhead_s=5e-3)
    profile = make_profile().model_copy(
        update={
            "params": pooled,
            "max_num_batched_tokens": [512, 1024, 2048],
            "params_by_budget": {512: CostParams(), 2048: at_2048},
        }
    )
    assert profile.params_for(2048) == at_2048 and profile.params_for(512) == CostParams()
    assert profile.params_for(384) == pooled and profile.params_for(1024) == pooled
    assert profile.budget_warning(2048) is None and profile.budget_warning(512) is None
    too_few = profile.budget_warning(1024)  # run at, but without a fit of its own
    assert too_few is not None and "no fit of its own" in too_few and "512, 1024, 2048" in too_few
    assert "was not calibrated" in (profile.budget_warning(384) or "")
    # JSON object keys are strings; the budgets come back as ints.
    again = CalibrationProfile.model_validate_json(profile.model_dump_json())
    assert again == profile and again.params_for(2048) == at_2048


def test_malformed_profile_names_file_and_field(tmp_path):
    raw = json.loads(make_profile().model_dump_json())
    path = tmp_path / "bad.json"

    raw["params"]["compute_eff"] = 0.5
    path.write_text(json.dumps(raw))
    with pytest.raises(KvsimConfigError, match=r"bad\.json: params\.compute_eff"):
        load_profile(path)

    raw["params"].pop("compute_eff")
    raw["num_steps"] = "many"
    path.write_text(json.dumps(raw))
    with pytest.raises(KvsimConfigError, match=r"bad\.json: num_steps = 'many'"):
        load_profile(path)

    raw["num_steps"] = 10
    for persistence, message in (
        ([[0.5, 1.0]], r"coefficient in 0\.\.1\); got \[0\.5, 1\.0\]"),
        ([[-0.1, 0.9]], r"got \[-0\.1, 0\.9\]"),
        ([[0.7, 0.9], [0.6, 0.99]], "shares sum to 1.3"),
    ):
        raw["step_residual_persistence"] = persistence
        path.write_text(json.dumps(raw))
        with pytest.raises(KvsimConfigError, match=r"bad\.json: step_residual_persistence"):
            load_profile(path)
        with pytest.raises(KvsimConfigError, match=message):
            load_profile(path)

    path.write_text("{not json")
    with pytest.raises(KvsimConfigError, match=r"bad\.json"):
        load_profile(path)


# A profile as `kvsim calibrate` wrote it before profiles recorded their token budgets (and
# before the schema moved out of sim/cost_model.py): still loads, with no budget claim and
# the defaults of the fields added since (source 'vllm', no environment, no measurements).
PROFILE_WITHOUT_BUDGETS = """{
  "params": {
    "mode": "additive",
    "compute_efficiency": 0.0312,
    "attention_compute_efficiency": 0.0071,
    "bandwidth_efficiency": 0.118,
    "step_overhead_s": 0.00171,
    "per_token_overhead_s": 0.0,
    "per_request_overhead_s": 6.1e-05,
    "prefill_step_overhead_s": 0.0035,
    "idle_wakeup_s": 0.0016,
    "post_prefill_decode_s": 0.00088,
    "allreduce_latency_s": 0.0,
    "kv_transfer_efficiency": 0.8
  },
  "hardware": "cpu",
  "model": "tiny-llama",
  "vllm_version": "0.32.0",
  "tensor_parallel_size": 1,
  "fit": {"r2": 0.97, "mape": 5.1, "max_abs_pct_error": 31.0, "outlier_frac": 0.002},
  "num_steps": 5210,
  "created_by": "kvsim calibrate runs/cal-prefill-sweep runs/cal-decode-sweep"
}
"""


def test_profiles_written_by_earlier_versions_still_load(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(PROFILE_WITHOUT_BUDGETS)
    profile = load_profile(path)
    assert profile.max_num_batched_tokens == []
    assert profile.params.post_prefill_decode_s == 0.00088
    assert profile.num_steps == 5210
    assert profile.budget_warning(512) is None
    assert profile.coverage([]) is None  # no shape cells recorded: no coverage claimed
    assert profile.source == "vllm" and profile.environment == profile.device_measurements == {}
    saved = tmp_path / "saved.json"
    save_profile(profile, saved)
    old = json.loads(PROFILE_WITHOUT_BUDGETS)
    assert json.loads(saved.read_text()) == {
        **old,
        "params": {
            **old["params"],
            "kernels": None,
            "idle_wakeup_log_s": 0.0,
            "shared_kv_bandwidth_efficiency": None,
            # An old profile priced no kernel builds, and still does not.
            "kernel_build_s": 0.0,
            "kernel_build_per_token_s": 0.0,
            "kernel_build_min_tokens": 64,
        },
        "max_num_batched_tokens": [],
        "params_by_budget": {},
        "source": "vllm",
        "environment": {},
        "shape_cells": [],
        "shape_cells_by_budget": {},
        "run_step_ratios": [],
        "held_out_run_step_ratios": [],
        "step_residual_quantiles": [],
        "step_residual_persistence": [],
        "held_out_metric_ratios": {},
        "stalled_runs": {},
        "device_measurements": {},
    }
