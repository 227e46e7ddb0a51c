"""What-if: pick or upload a scenario, edit its key knobs, simulate, read the summary, save.

With a calibration profile (``kvsim calibrate``'s JSON, uploaded) the run is priced by it,
and with samples the page also draws the uncertainty band of ``kvsim run --samples``
(sim/uncertainty.py), shows it under the summary and saves it with the run (samples.json).

The title is drawn before anything heavy is imported: the simulator and the charts load
while it is on screen (the first page must paint within a second). Every failure (a
scenario, model config or trace that cannot be read, a simulation that raises, a save that
cannot write) is one ``st.error`` paragraph (``dashboard.errors``), never a traceback.
"""

# ruff: noqa: E402 (imports after the title, on purpose)

from __future__ import annotations

import streamlit as st

st.title("What-if")
st.caption(
    "Change a vLLM config or the traffic and see what the simulated engine does with it. "
    "Edits are applied as `--set` overrides on the scenario, exactly like `kvsim run --set`."
)

import hashlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dashboard.errors import guard, show_error
from dashboard.knobs import Knob, build_overrides, knobs_for, question, scenario_from
from dashboard.locations import runs_dir
from sim.config.loading import load_yaml
from sim.errors import KvsimConfigError
from sim.scenario import SCENARIO_DIR

if TYPE_CHECKING:
    from sim.config.calibration import CalibrationProfile
    from sim.scenario import Scenario

RESULT = "what_if_result"
# The most samples the page draws (each is a whole run; kvsim run --samples takes any N).
MAX_SAMPLES = 50


def _read_source() -> tuple[str, str, Path | None, str] | None:
    """(scenario text, source name, base dir for relative paths, widget-key prefix)."""
    source = st.radio(
        "Scenario", ["shipped scenario", "upload YAML"], horizontal=True, key="wi-source"
    )
    if source == "shipped scenario":
        files = sorted(SCENARIO_DIR.glob("*.yaml"))
        if not files:  # an install that left scenarios/ out (a wheel ships it beside sim/)
            st.error(
                f"No shipped scenario in {SCENARIO_DIR} (no *.yaml there): this kvsim was "
                "installed without its scenarios/ folder. Reinstall it (in a checkout: pip "
                "install -e .), or pick 'upload YAML' above and upload a scenario of your own."
            )
            return None
        default = next((i for i, f in enumerate(files) if f.stem.startswith("coding")), 0)
        path = st.selectbox(
            "Shipped scenario", files, index=default, format_func=lambda p: p.name, key="wi-file"
        )
        return path.read_text(), f"scenarios/{path.name}", SCENARIO_DIR, f"wi-{path.stem}"
    upload = st.file_uploader("Scenario YAML", type=["yaml", "yml"], key="wi-upload")
    if upload is None:
        st.info("Upload a scenario file (see `scenarios/` and the README for the format).")
        return None
    data = upload.getvalue()
    digest = hashlib.sha1(data).hexdigest()[:8]
    st.caption("Relative paths in an uploaded scenario (traces, config.json) cannot be resolved.")
    return data.decode("utf-8", errors="replace"), upload.name, None, f"wi-up-{digest}"


def _knob_widget(knob: Knob, key: str) -> Any:
    if knob.kind == "select":
        options = list(knob.options)
        index = options.index(knob.default) if knob.default in options else 0
        return st.selectbox(knob.label, options, index=index, key=key, help=knob.help)
    if knob.kind == "bool":
        return st.checkbox(knob.label, value=bool(knob.default), key=key, help=knob.help)
    if knob.kind == "int":
        return st.number_input(
            knob.label, value=int(knob.default), min_value=int(knob.min_value or 1),
            step=int(knob.step or 1), key=key, help=knob.help,
        )  # fmt: skip
    return st.number_input(
        knob.label, value=float(knob.default), min_value=knob.min_value,
        max_value=knob.max_value, step=knob.step, format="%.3f", key=key, help=knob.help,
    )  # fmt: skip


def _calibration_widgets() -> tuple[Any, int, bool]:
    """(the uploaded profile file or None, samples, vary the seed): the calibration widgets,
    inside the form (read when it is submitted)."""
    with st.expander("Calibration and uncertainty band"):
        st.caption(
            "A calibration profile (`kvsim calibrate`'s JSON) prices the steps, as `kvsim run "
            "--calibration` does; samples rerun the scenario at the step speeds of its measured "
            "runs (latencies and throughput times the fit's model error held out on its "
            "calibration scenarios, where it records one), as `kvsim run --samples` does, and "
            "report each metric's p10-p90 band."
        )
        upload = st.file_uploader("Calibration profile", type=["json"], key="wi-profile")
        samples = st.number_input(
            "Samples (0: none)", min_value=0, max_value=MAX_SAMPLES, value=0, step=1,
            key="wi-samples", help="Each sample is one more run of the scenario.",
        )  # fmt: skip
        vary_seed = st.checkbox("Vary the workload seed too", key="wi-vary-seed")
    return upload, int(samples), bool(vary_seed)


def _read_profile(upload: Any, samples: int) -> CalibrationProfile | None:
    """The uploaded profile, checked for what ``samples`` need; KvsimConfigError names the
    file and the field."""
    import pydantic

    from sim.config.calibration import CalibrationProfile
    from sim.errors import format_validation_error

    if upload is None:
        if samples:
            raise KvsimConfigError(
                f"{samples} samples draw step speeds from the measured runs of a calibration "
                "profile: upload one (kvsim calibrate writes it) under 'Calibration and "
                "uncertainty band', or set the samples to 0"
            )
        return None
    try:
        profile = CalibrationProfile.model_validate_json(upload.getvalue())
    except pydantic.ValidationError as exc:  # bad JSON included
        message = format_validation_error(exc, upload.name)
        raise KvsimConfigError(f"not a calibration profile: {message}") from None
    if samples and not profile.run_step_ratios:
        raise KvsimConfigError(
            f"{upload.name} records no measured run spread (run_step_ratios is empty: it was "
            "not fitted by kvsim calibrate on measured runs, or before kvsim recorded them); "
            "samples draw from a profile that does, or set the samples to 0"
        )
    return profile


def _run(
    scenario: Scenario,
    overrides: list[str],
    source: str,
    profile: CalibrationProfile | None = None,
    profile_name: str | None = None,
    samples: int = 0,
    vary_seed: bool = False,
) -> None:
    with st.spinner("Loading the simulator..."):
        from sim.runner import simulate

    bar = st.progress(0.0, text=f"simulating {scenario.name}...")
    limit_s = scenario.limits.max_duration_s

    def progress(now_s: float, finished: int, expected: int | None) -> None:
        frac = finished / expected if expected else now_s / limit_s
        total = f"{expected:,}" if expected else "?"
        bar.progress(
            min(max(frac, 0.0), 1.0),
            text=f"sim t = {now_s:,.0f} s, {finished:,}/{total} requests done",
        )

    started = time.perf_counter()
    band = band_warning = None
    try:
        result = simulate(scenario, calibration=profile, progress=progress)
        notes = _calibration_notes(profile, result)
        if samples and profile is not None:
            from sim.uncertainty import band_records, band_rows, run_samples, truncation_warning

            bar.progress(0.0, text=f"sampling step speeds: 0/{samples} runs")

            def sampled(k: int) -> None:
                bar.progress(k / samples, text=f"sampling step speeds: {k}/{samples} runs")

            factors, summaries = run_samples(
                scenario, profile, samples, vary_seed, on_done=sampled, on_serial=st.info
            )
            rows = band_rows(result.summary, summaries, profile)
            band = band_records(rows, factors, summaries, profile)
            band_warning = truncation_warning(result.summary, summaries)
    except Exception as exc:  # KvsimConfigError (sizing, a trace), or whatever else breaks
        bar.empty()
        show_error(exc, f"{source}: simulating {scenario.name}")
        return
    bar.empty()
    st.session_state[RESULT] = {
        "result": result,
        "wall_s": time.perf_counter() - started,
        "overrides": overrides,
        "source": source,
        "saved": None,
        "profile_name": profile_name,
        "calibration_notes": notes,
        "samples": samples,
        "vary_seed": vary_seed,
        "band": band,
        "band_warning": band_warning,
    }


def _show_result(state: dict[str, Any]) -> None:
    with st.spinner("Loading the charts..."):
        from dashboard import charts
        from dashboard.components import show_summary
        from dashboard.data import (
            REPLICA,
            every_kth,
            flatten_times,
            fleet_totals,
            latency_cdfs,
            num_replicas,
        )
        from sim.results import claim_new_run_dir

    result = state["result"]
    st.subheader("Result")
    command = ["kvsim run", state["source"], *(f"--set {o}" for o in state["overrides"])]
    command += _calibration_options(state)
    samples = state.get("samples", 0)
    what = f" and {samples} samples" if samples else ""
    st.caption(f"Simulated{what} in {state['wall_s']:.1f} s wall. Equivalent command:")
    st.code(" ".join(command), language="bash")
    notes = state.get("calibration_notes") or {}
    if notes.get("coverage"):
        st.caption(f"Shape coverage: {notes['coverage']}")
    for warning in notes.get("warnings", []):
        st.warning(warning)
    show_summary(result.summary, key="wi")
    band = state.get("band")
    if band is not None:
        from dashboard.loaders import band_frame

        table, num_samples = band_frame(band)
        st.markdown(f"**Uncertainty band** ({num_samples} samples)")
        jitter = (
            " and each step's own jitter"
            + (" (persistent, as measured)" if band.get("step_persistence") else "")
            if band.get("step_jitter")
            else ""
        )
        seeds = ", with workload seeds seed + i" if state.get("vary_seed") else ""
        st.caption(
            f"The scenario again at the run speeds{jitter} of the calibration's measured "
            f"runs{seeds}: each metric at the profile as fitted, and the samples' median and "
            "p10-p90."
        )
        st.dataframe(table, hide_index=True, key="wi-band")
        if state.get("band_warning"):
            st.warning(state["band_warning"])

    steps = result.steps
    fleet = result.summary.get("fleet") if REPLICA in steps.columns else None
    if fleet is not None:  # the fleet as one engine: no zig-zag between the replicas
        steps = fleet_totals(steps, num_replicas(result.requests, steps, fleet))
    sampled = every_kth(steps)
    events = steps[steps["num_preemptions"] > 0]
    fig = charts.timeline_figure(sampled.frame, events, title="KV cache and requests over time")
    st.plotly_chart(fig, key="wi-timeline")
    note = sampled.note()
    if fleet is not None:
        note = (f"{note}; " if note else "") + (
            f"a fleet of {fleet.get('replicas', '?')} replicas: KV usage is their mean and "
            "requests their sum (save the run and open it in the Run explorer for each "
            "replica's figures)."
        )
    if note:
        st.caption(note)
    cdfs = latency_cdfs(result.requests, flatten_times(result.requests["token_times_s"]))
    cols = st.columns(3)
    for col, metric in zip(cols, ("ttft", "itl", "e2e"), strict=True):
        col.plotly_chart(charts.cdf_figure(cdfs, metric), key=f"wi-cdf-{metric}")

    base = runs_dir()
    name_col, button_col = st.columns([3, 1], vertical_alignment="bottom")
    name = name_col.text_input("Run name", value=result.scenario.name, key="wi-save-name")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or result.scenario.name
    if button_col.button("Save run", key="wi-save", disabled=state["saved"] is not None):
        writers: list[Callable[[Path], Any]] = []
        if band is not None:
            from sim.uncertainty import SAMPLES

            text = json.dumps(band, indent=2) + "\n"
            writers.append(lambda d: (d / SAMPLES).write_text(text))
        with guard(f"saving the run to {base}"):
            # Claimed atomically: two sessions saving at once get two folders.
            out = result.write(claim_new_run_dir(base, name), writers)  # with its block map
        state["saved"] = out
        st.rerun()
    if state["saved"] is not None:
        st.success(f"Saved to `{state['saved']}`: open it in the Run explorer.")


def _calibration_options(state: dict[str, Any]) -> list[str]:
    """The run's calibration options as kvsim run takes them."""
    name = state.get("profile_name")
    if name is None:
        return []
    options = [f"--calibration {name}"]
    if state.get("samples"):
        options.append(f"--samples {state['samples']}")
        if state.get("vary_seed"):
            options.append("--vary-seed")
    return options


def _calibration_notes(profile: CalibrationProfile | None, result: Any) -> dict[str, Any]:
    """What kvsim run says of a profile (fitted on other hardware or at another token
    budget, steps outside its shapes), computed once per run."""
    if profile is None:
        return {}
    from sim.config.calibration import hardware_warning
    from sim.step_record import shapes_of_steps

    scenario = result.scenario
    warnings = [
        hardware_warning(profile, scenario.hardware.name),
        profile.budget_warning(scenario.engine.max_num_batched_tokens),
    ]
    coverage = profile.coverage(
        shapes_of_steps(result.steps), scenario.engine.max_num_batched_tokens
    )
    if coverage is not None:
        warnings.append(coverage.warning())
    return {
        "coverage": coverage.line() if coverage is not None else None,
        "warnings": [w for w in warnings if w],
    }


with guard("reading the scenario"):
    picked = _read_source()
if picked is not None:
    text, source_name, base_dir, prefix = picked
    try:
        # kvsim's own reader: duplicate keys and alias bombs are refused, never expanded.
        document = load_yaml(text, source_name)
    except KvsimConfigError as exc:
        st.error(str(exc))
        st.stop()
    except Exception as exc:
        show_error(exc, f"{source_name}: reading the YAML")
        st.stop()
    if not isinstance(document, dict):
        st.error(f"{source_name}: a scenario is a YAML mapping, got {type(document).__name__}")
        st.stop()
    with guard(f"{source_name}: reading the knobs"):
        if q := question(text):
            st.info(q)
        knobs = knobs_for(document)
        with st.form(f"{prefix}-form"):
            cols = st.columns(4)
            values = {}
            for i, knob in enumerate(knobs):
                with cols[i % 4]:
                    values[knob.path] = _knob_widget(knob, f"{prefix}-{knob.path}")
            upload, num_samples, vary_seed = _calibration_widgets()
            submitted = st.form_submit_button("Run simulation", type="primary", key="wi-run")
    if submitted:
        try:
            overrides = build_overrides(knobs, values)
            scenario = scenario_from(document, overrides, source_name, base_dir)
            profile = _read_profile(upload, num_samples)
        except Exception as exc:  # KvsimConfigError, or a model/trace file that breaks
            show_error(exc, source_name)
        else:
            name = upload.name if upload is not None else None
            _run(scenario, overrides, source_name, profile, name, num_samples, vary_seed)

if RESULT in st.session_state:
    with guard("showing the result"):
        _show_result(st.session_state[RESULT])
