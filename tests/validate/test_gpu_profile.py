"""validate/gpu_measure.py, validate/gpu_stack.py and validate/gpu_profile.py on the CPU: the
tiny geometry's measure run, fit, merge, compare.

Marked ``vllm`` because the measuring half needs torch, which only the vLLM environment has.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from sim.config.calibration import load_profile, save_profile
from sim.config.hardware import resolve_hardware
from sim.cost_model import CostModel, CostParams
from sim.errors import KvsimConfigError
from tests.validate.standalone import run_alone
from validate.gpu_measure import (
    GEOMETRIES,
    RAW_FORMAT,
    _grid_points,
    batch_shape_fields,
    measure,
)
from validate.gpu_profile import (
    MERGE_MARGIN,
    compare_rows,
    fit_profile,
    load_raw,
    main,
    merge_raws,
    raw_shapes,
    regime_summary,
)
from validate.gpu_stack import DecoderStack

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def torch() -> Any:
    """torch, imported when a test runs (never at collection: the fast lane has no torch)."""
    import torch

    return torch


SHAPE_FIELDS = (
    "num_prefill_tokens",
    "num_prefill_reqs",
    "prefill_attention_pairs",
    "num_decode_reqs",
    "decode_context_tokens",
)


@pytest.fixture(scope="module")
def tiny_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu_profile") / "tiny-raw.json"
    measure(out, "tiny", "cpu", quick=True, budget_s=600.0)
    return out


def test_measure_writes_every_grid_point_with_its_batch_shape(tiny_raw: Path, torch: Any) -> None:
    raw = json.loads(tiny_raw.read_text())
    assert raw["format"] == RAW_FORMAT
    assert raw["complete"] is True
    assert raw["skipped"] == [] and raw["failed"] == []
    assert raw["geometry"]["name"] == "tiny-torch"
    assert raw["environment"]["torch"] == torch.__version__
    assert raw["attention"]["path"] == "sdpa"
    assert raw["attention"]["split_kv"].startswith("auto")
    assert raw["timing"]["method"] == "time.perf_counter"
    assert raw["micro"]["device_copy_bytes_per_s"] > 0
    assert raw["micro"]["bf16_matmul_flops_per_s"] > 0
    points = _grid_points("tiny")
    assert len(raw["steps"]) == len(points) == 15
    for point, step in zip(points, raw["steps"], strict=True):
        assert step["regime"] == point["regime"]
        assert step["decode_context_per_req"] == point["decode_context_tokens"]
        for key, value in batch_shape_fields(point).items():
            assert step[key] == value
        assert step["median_s"] == step["eager_median_s"] > 0
        assert step["eager_min_s"] <= step["median_s"] <= step["eager_max_s"]
        assert 3 <= step["reps"] <= 5
    # Every regime is on the grid: prefill with and without context, decode, mixed.
    assert {s["regime"] for s in raw["steps"]} == {"prefill", "decode", "mixed"}
    assert any(s["num_prefill_reqs"] > 1 for s in raw["steps"])
    # The raw file loads back through the fit half's checks.
    assert load_raw(tiny_raw)["steps"] == raw["steps"]


def test_batch_shape_fields_count_pairs_and_decode_context_like_the_scheduler() -> None:
    point = {
        "num_prefill_reqs": 2,
        "chunk_tokens": 100,
        "prefill_context_tokens": 300,
        "num_decode_reqs": 5,
        "decode_context_tokens": 700,
    }
    assert batch_shape_fields(point) == {
        "num_prefill_tokens": 200,
        "num_prefill_reqs": 2,
        "prefill_attention_pairs": 2 * 100 * (300 + 50.0),
        "num_decode_reqs": 5,
        "decode_context_tokens": 3500,
    }


def test_grid_skips_points_the_kv_pool_cannot_hold(tmp_path: Path, torch: Any) -> None:
    # A KV pool of 1 MiB of tiny KV (512 B/token) holds 2048 tokens: 16 decodes at 256 do not fit.
    stack = DecoderStack(torch, GEOMETRIES["tiny"], torch.device("cpu"), 2048, 16)
    point = {
        "num_prefill_reqs": 0,
        "chunk_tokens": 0,
        "prefill_context_tokens": 0,
        "num_decode_reqs": 16,
        "decode_context_tokens": 256,
    }
    with pytest.raises(MemoryError, match="needs 272 KV pages, pool holds 128"):
        stack.build_batch(point, paged=False)


def test_time_budget_stops_adding_points_and_still_writes(tmp_path: Path) -> None:
    out = tmp_path / "cut.json"
    measure(out, "tiny", "cpu", quick=True, budget_s=1e-3)
    raw = json.loads(out.read_text())
    assert raw["complete"] is False
    assert raw["steps"] == []
    assert len(raw["skipped"]) == 15
    assert {s["reason"] for s in raw["skipped"]} == {"time budget spent"}


def _naive_attention(torch: Any, stack: Any, batch: dict[str, Any], q: Any) -> Any:
    """Per request, per query token and head: softmax over the keys it may see, in float32."""
    g = stack.g
    heads, kv_heads, hd = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
    k_all = stack.k_pool[0].view(-1, kv_heads, hd).float()
    v_all = stack.v_pool[0].view(-1, kv_heads, hd).float()
    out = torch.empty(q.shape)
    cu, seqused, table = batch["cu_q"], batch["seqused_k"], batch["block_table"]
    for i in range(len(seqused)):
        kv_len = int(seqused[i])
        pos = torch.arange(kv_len)
        slots = table[i][pos // stack.page].long() * stack.page + pos % stack.page
        k, v = k_all[slots], v_all[slots]
        first, last = int(cu[i]), int(cu[i + 1])
        for t in range(last - first):
            # A chunk's token t sees the context and the chunk up to itself; a decode sees
            # its context (kv_len == ctx).
            visible = kv_len - (last - first) + t + 1 if last - first > 1 else kv_len
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                scores = k[:visible, kvh] @ q[first + t, h].float() / math.sqrt(hd)
                out[first + t, h] = torch.softmax(scores, 0) @ v[:visible, kvh]
    return out


@pytest.mark.parametrize("split_mode", ["off", "always"])
@pytest.mark.parametrize(
    "point",
    [
        (1, 8, 256, 3, 64),  # prefill split in 4, decodes split in 2 ("always")
        (1, 20, 128, 1, 256),
        (2, 20, 37, 3, 50),  # contexts off the page grid: nothing splits
        (1, 33, 0, 0, 0),
    ],
)
def test_sdpa_attention_matches_a_naive_reference(
    point: tuple[int, ...], split_mode: str, torch: Any
) -> None:
    g = GEOMETRIES["tiny"]
    stack = DecoderStack(torch, g, torch.device("cpu"), 8192, 16)
    stack.split_mode = split_mode
    keys = (
        "num_prefill_reqs",
        "chunk_tokens",
        "prefill_context_tokens",
        "num_decode_reqs",
        "decode_context_tokens",
    )
    batch = stack.build_batch(dict(zip(keys, point, strict=True)), paged=False)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(
        batch["ids"].shape[0],
        g["num_attention_heads"],
        g["head_dim"],
        generator=gen,
        dtype=torch.bfloat16,
    )
    got = stack._attention_sdpa(0, q, batch).float()
    assert (got - _naive_attention(torch, stack, batch, q)).abs().max() < 0.02
    if split_mode == "always" and point[0] == 1 and point[2] == 256:
        assert stack.splits_for(dict(zip(keys, point, strict=True))) == (4, 2)


def test_auto_split_only_splits_few_decodes_at_long_context(torch: Any) -> None:
    stack = DecoderStack(
        torch,
        GEOMETRIES["llama-3.1-8b"]
        | {"num_hidden_layers": 1, "vocab_size": 16, "hidden_size": 64, "intermediate_size": 64},
        torch.device("cpu"),
        256,
        256,
    )
    stack.split_target = 264  # an H200: 132 SMs
    decode = {"num_prefill_reqs": 0, "chunk_tokens": 0, "prefill_context_tokens": 0}
    prefill = {
        "num_prefill_reqs": 1,
        "chunk_tokens": 128,
        "prefill_context_tokens": 32768,
        "num_decode_reqs": 0,
        "decode_context_tokens": 0,
    }

    def splits(n: int, ctx: int) -> tuple[int, int]:
        return stack.splits_for({**decode, "num_decode_reqs": n, "decode_context_tokens": ctx})

    # "auto": decodes of <= 4 requests at >= 8192 tokens, as many splits as fill 2 x 132 SMs.
    assert splits(1, 32768) == (1, 64)
    assert splits(4, 8192) == (1, 16)
    assert splits(8, 32768) == (1, 1)
    assert splits(1, 2048) == (1, 1)
    assert stack.splits_for(prefill) == (1, 1)
    stack.split_mode = "always"
    assert stack.splits_for(prefill) == (16, 1)
    assert splits(8, 32768) == (1, 8)
    assert splits(1, 2048) == (1, 8)
    stack.split_mode = "off"
    assert splits(1, 32768) == (1, 1)
    assert stack.splits_for(prefill) == (1, 1)


def test_fit_writes_a_loadable_profile(tiny_raw: Path, tmp_path: Path, torch: Any) -> None:
    raw = load_raw(tiny_raw)
    profile = fit_profile(raw, "H200-141GB", "test")
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded == profile
    assert loaded.source == "torch-kernels"
    assert loaded.model == "tiny-torch"
    assert loaded.hardware == "H200-141GB"  # the preset: runs on it draw no hardware warning
    assert loaded.environment["device_name"] == raw["environment"]["device_name"]
    assert loaded.num_steps == len(raw["steps"]) == int(loaded.fit["num_steps"])
    assert loaded.params.mode == "additive"
    assert loaded.environment["torch"] == torch.__version__
    assert loaded.environment["attention"] == "sdpa"
    assert loaded.device_measurements == raw["micro"]
    # No host<->device measurement on the CPU: the transfer efficiency keeps its default.
    assert loaded.params.kv_transfer_efficiency == CostParams().kv_transfer_efficiency
    assert set(loaded.fit) >= {"r2", "mape", "max_abs_pct_error", "rmse_s"}


def test_fit_prices_transfers_at_the_measured_host_bandwidth(tiny_raw: Path) -> None:
    raw = load_raw(tiny_raw)
    raw["micro"] |= {"h2d_pinned_bytes_per_s": 48e9, "d2h_pinned_bytes_per_s": 40e9}
    profile = fit_profile(raw, "H200-141GB", "test")
    assert profile.params.kv_transfer_efficiency == pytest.approx(40e9 / 64e9)


def test_fit_recovers_known_parameters_from_synthetic_steps(tiny_raw: Path) -> None:
    raw = load_raw(tiny_raw)
    truth = CostParams(
        mode="additive",
        compute_efficiency=0.5,
        attention_compute_efficiency=0.25,
        bandwidth_efficiency=0.7,
        step_overhead_s=2e-3,
        per_request_overhead_s=0.0,
    )
    from validate.gpu_profile import raw_model

    hw = resolve_hardware("H200-141GB")
    model = raw_model(raw)
    cost = CostModel(model, hw, 1, truth)
    shapes, _ = raw_shapes(raw)
    for step, shape in zip(raw["steps"], shapes, strict=True):
        step["median_s"] = cost.step_time_s(shape)
    profile = fit_profile(raw, "H200-141GB", "test")
    assert profile.fit["mape"] < 1e-6
    assert profile.params.step_overhead_s == pytest.approx(2e-3, rel=1e-6)


def test_compare_rows_price_the_roofline_preset(tiny_raw: Path) -> None:
    raw = load_raw(tiny_raw)
    rows = compare_rows(raw, "H200-141GB")
    roofline = CostModel(raw_model_of(raw), resolve_hardware("H200-141GB"), 1, CostParams())
    shapes, durations = raw_shapes(raw)
    for row, shape, measured in zip(rows, shapes, durations, strict=True):
        assert row["measured_s"] == measured
        assert row["roofline_s"] == roofline.step_time_s(shape)
        assert row["roofline_err_pct"] == pytest.approx(100 * (row["roofline_s"] / measured - 1))
        assert "fitted_s" not in row
    summary = regime_summary(rows)
    assert sum(s["points"] for s in summary.values()) == len(rows)


def raw_model_of(raw: dict[str, Any]) -> Any:
    from validate.gpu_profile import raw_model

    return raw_model(raw)


def test_merge_keeps_a_later_run_only_when_clearly_faster(tiny_raw: Path) -> None:
    first = load_raw(tiny_raw)
    second = copy.deepcopy(first)
    second["steps"][0]["median_s"] *= 1.0 - 2 * MERGE_MARGIN  # clearly faster: taken
    second["steps"][1]["median_s"] *= 1.0 - MERGE_MARGIN / 2  # within noise: not taken
    second["steps"][2]["median_s"] *= 1.5  # slower: not taken
    merged = merge_raws([("a.json", first), ("b.json", second)])
    assert [s["run"] for s in merged["steps"]] == [1] + [0] * (len(first["steps"]) - 1)
    assert merged["steps"][0]["median_s"] == second["steps"][0]["median_s"]
    assert merged["steps"][1]["median_s"] == first["steps"][1]["median_s"]
    assert merged["steps"][2]["median_s_by_run"] == [
        first["steps"][2]["median_s"],
        second["steps"][2]["median_s"],
    ]
    assert [m["steps_kept"] for m in merged["merged_from"]] == [len(first["steps"]) - 1, 1]
    assert merged["micro"] == first["micro"]


def test_merge_refuses_runs_of_other_models(tiny_raw: Path) -> None:
    first = load_raw(tiny_raw)
    other = copy.deepcopy(first)
    other["geometry"]["name"] = "Llama-3.1-8B"
    with pytest.raises(KvsimConfigError, match="merge only runs of one model on one device"):
        merge_raws([("a.json", first), ("b.json", other)])
    with pytest.raises(KvsimConfigError, match="at least two raw files"):
        merge_raws([("a.json", first)])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(format="other/1"), "format='other/1', expected"),
        (lambda r: r.pop("micro"), "field 'micro' is missing"),
        (lambda r: r.update(steps=[]), "steps is empty"),
        (lambda r: r["steps"][3].update(median_s=-1.0), r"steps\[3\].median_s=-1.0"),
        (lambda r: r["steps"][0].pop("num_decode_reqs"), r"steps\[0\].num_decode_reqs=None"),
    ],
)
def test_bad_raw_files_give_one_line_errors(
    tiny_raw: Path, tmp_path: Path, mutate: Any, message: str
) -> None:
    raw = json.loads(tiny_raw.read_text())
    mutate(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(KvsimConfigError, match=message):
        load_raw(path)


def test_cli_errors_exit_2_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.json"
    assert main(["fit", str(missing), "-o", str(tmp_path / "p.json")]) == 2
    assert f"cannot read raw GPU measurements {missing}" in capsys.readouterr().err
    out = tmp_path / "x.json"
    assert main(["measure", "--out", str(out), "--geometry", "llama-9b", "--device", "cpu"]) == 2
    assert "--geometry 'llama-9b' is not known; choose one of llama-3.1-8b, tiny" in (
        capsys.readouterr().err
    )
    assert main(["measure", "--out", str(out), "--device", "tpu"]) == 2
    assert "--device 'tpu' must be 'cuda' or 'cpu'" in capsys.readouterr().err
    assert main(["measure", "--out", str(out), "--device", "cpu", "--split-kv", "x"]) == 2
    assert "--split-kv 'x' must be one of auto, always, off" in capsys.readouterr().err
    assert not out.exists()


def test_the_measuring_script_runs_alone_without_kvsim(tmp_path: Path) -> None:
    """gpu_measure.py and gpu_stack.py copied alone (what goes onto a GPU box) run, import
    nothing of kvsim and write their errors as one line, exit status 2."""
    last, stderr = run_alone(
        tmp_path, ("gpu_measure.py", "gpu_stack.py"), ["--out", "x.json", "--device", "tpu"]
    )
    assert last == "exit 2 kvsim []"
    assert stderr == "error: --device 'tpu' must be 'cuda' or 'cpu'\n"
    assert not (tmp_path / "x.json").exists()


def test_cli_fit_and_compare(
    tiny_raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "p.json"
    assert main(["fit", str(tiny_raw), "-o", str(profile)]) == 0
    assert "fitted 15 steps of tiny-torch" in capsys.readouterr().out
    assert load_profile(profile).num_steps == 15
    assert main(["compare", str(tiny_raw), "--profile", str(profile), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| regime | point | measured ms | roofline ms | roofline err |")
    assert out.count("\n|") == 1 + 15  # separator row and one row per step
    assert main(["fit", str(tiny_raw), "-o", str(profile), "--hardware", "H300"]) == 2
    assert "hardware 'H300' is not a preset" in capsys.readouterr().err


def test_the_committed_h200_profile_loads_and_matches_its_raw_file() -> None:
    root = Path(__file__).resolve().parents[2] / "validate" / "profiles"
    profile = load_profile(root / "h200-llama-3.1-8b.json")
    raw = load_raw(root / "h200-llama-3.1-8b.raw.json")
    assert (profile.hardware, profile.model, profile.source) == (
        "H200-141GB",
        "Llama-3.1-8B",
        "torch-kernels",
    )
    assert profile.num_steps == len(raw["steps"]) == 82
    refit = fit_profile(raw, "H200-141GB", profile.created_by)
    # The same fit, to rounding: a least-squares solve's last bits depend on the CPU's BLAS
    # kernels (the committed file was fitted on another machine).
    assert refit.model_dump() == _approx_floats(profile.model_dump())


def _approx_floats(node: Any) -> Any:
    """``node`` with every float compared to 1e-9 relative (for ``==`` with a plain dump)."""
    if isinstance(node, dict):
        return {key: _approx_floats(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_approx_floats(value) for value in node]
    if isinstance(node, float):
        return pytest.approx(node, rel=1e-9, abs=1e-15)
    return node
