"""The KV waste breakdown (sim/kv/waste.py): exact per-sample parts for paged and contiguous
allocators, the time weighting, and the opt-in that leaves the default run unchanged."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from sim.cli import app
from sim.config.retention import RetentionConfig
from sim.kv.allocators import ContiguousKVManager
from sim.kv.kv_cache_manager import KVCacheManager
from sim.kv.waste import (
    COLUMNS,
    PARTS,
    contiguous_breakdown,
    idle_blocks,
    kv_waste_breakdown,
    paged_breakdown,
)
from sim.request import Request
from sim.runner import simulate
from sim.scenario import parse_scenario
from sim.workload.base import SessionHint

BLOCK_SIZE = 16


def request(request_id: str, prompt: int, max_tokens: int = 1) -> Request:
    base = 100_000 * (1 + len(request_id)) + sum(map(ord, request_id)) * 1000
    return Request(request_id, list(range(base, base + prompt)), max_tokens, block_size=BLOCK_SIZE)


def admit_computed(kv: Any, req: Request) -> None:
    """Admit a waiting request with its whole prompt, then mark it computed (a step)."""
    assert (
        kv.allocate_slots(req, req.num_tokens, full_sequence_must_fit=True, has_scheduled_reqs=True)
        is not None
    )
    req.num_computed_tokens = req.num_tokens


def test_paged_internal_fragmentation_is_the_partial_last_blocks() -> None:
    lengths = [1, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 1000]
    kv = KVCacheManager(1000, BLOCK_SIZE, max_model_len=4096, enable_caching=False)
    running = [request(f"r{i}", n) for i, n in enumerate(lengths)]
    for req in running:
        admit_computed(kv, req)
    sample = dict(zip(COLUMNS, paged_breakdown(kv, running), strict=True))
    expected_internal = sum(-(-n // 16) * 16 - n for n in lengths)
    assert expected_internal == 15 + 1 + 0 + 15 + 1 + 0 + 15 + 12 + 1 + 0 + 15 + 8
    assert sample["internal_fragmentation"] == expected_internal
    assert sample["stored"] == sum(lengths)
    assert sample["reserved_unused"] == sample["external_fragmentation"] == 0
    assert sample["num_live"] == len(lengths)
    assert sum(sample[p] for p in PARTS) == 999 * BLOCK_SIZE


def test_paged_waste_is_half_a_block_less_half_a_slot_per_request_on_average() -> None:
    """Lengths covering every residue mod 16 equally: the mean partial-block waste is exactly
    (0 + 1 + ... + 15) / 16 = 7.5 slots, about half a block, per live request."""
    lengths = list(range(1, 16 * 40 + 1))
    kv = KVCacheManager(30_000, BLOCK_SIZE, max_model_len=4096, enable_caching=False)
    running = [request(f"q{i}", n) for i, n in enumerate(lengths)]
    for req in running:
        admit_computed(kv, req)
    sample = dict(zip(COLUMNS, paged_breakdown(kv, running), strict=True))
    per_request = sample["internal_fragmentation"] / len(lengths)
    assert per_request == 7.5
    assert abs(per_request - BLOCK_SIZE / 2) / (BLOCK_SIZE / 2) < 0.07  # "half a block"


def test_paged_shared_prefix_blocks_count_once() -> None:
    kv = KVCacheManager(100, BLOCK_SIZE, max_model_len=4096, enable_caching=True)
    prefix = list(range(64))
    a = Request("a", [*prefix, 900, 901], 1, block_size=BLOCK_SIZE)
    b = Request("b", [*prefix, 902, 903, 904], 1, block_size=BLOCK_SIZE)
    admit_computed(kv, a)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 64
    assert kv.allocate_slots(b, 3, num_new_computed_tokens=64, new_computed_blocks=hits)
    b.num_computed_tokens = b.num_tokens
    sample = dict(zip(COLUMNS, paged_breakdown(kv, [a, b]), strict=True))
    # 4 shared full blocks + 2 private tails: 6 blocks hold 64 + 2 + 3 tokens.
    assert sample["stored"] == 69
    assert sample["internal_fragmentation"] == 14 + 13
    assert sample["free"] == (99 - 6) * BLOCK_SIZE


def test_paged_blocks_only_a_retention_pin_holds_are_held_idle_not_stored() -> None:
    kv = KVCacheManager(20, BLOCK_SIZE, max_model_len=1024, enable_caching=True)
    kv.enable_retention(RetentionConfig(policy="ttl", ttl_s=60.0), lambda: 0.0)
    prefix = list(range(32))  # 2 full blocks both turns share
    hint = SessionHint(0, returns=True)
    done = Request(
        "s0-t0", [*prefix, *range(500, 532)], 1, block_size=BLOCK_SIZE, session_hint=hint
    )
    admit_computed(kv, done)
    other = Request("s1-t0", [*prefix, 900], 1, block_size=BLOCK_SIZE)
    hits, num_hit = kv.get_computed_blocks(other)
    assert num_hit == 32
    assert kv.allocate_slots(other, 1, num_new_computed_tokens=32, new_computed_blocks=hits)
    other.num_computed_tokens = other.num_tokens
    done.mark_running(done.num_tokens)
    done.mark_finished()
    kv.free(done)  # its 4 full blocks are pinned: 2 shared with `other`, 2 its own
    assert kv.retention is not None and kv.retention.num_held_blocks == 4
    sample = dict(zip(COLUMNS, paged_breakdown(kv, [other]), strict=True))
    # `other` holds the 2 shared blocks and its tail; only the pin holds the other 2.
    assert sample["held_idle"] == 2 * BLOCK_SIZE
    assert sample["stored"] == 33
    assert sample["internal_fragmentation"] == 15
    assert sum(sample[p] for p in PARTS) == 19 * BLOCK_SIZE
    # Were `other` not running (e.g. waiting for an offload load), every block in use would
    # be idle: the 4 pinned ones and its tail.
    assert idle_blocks(kv, []) == 5


def test_static_reserved_unused_is_max_model_len_minus_the_live_length() -> None:
    kv = ContiguousKVManager("static", 1 + 6 * 64, BLOCK_SIZE, max_model_len=1024)
    lengths = [5, 100, 640, 1000]
    running = [request(f"s{i}", n, max_tokens=2) for i, n in enumerate(lengths)]
    for req in running:
        admit_computed(kv, req)
    sample = dict(zip(COLUMNS, contiguous_breakdown(kv, running, None), strict=True))
    assert sample["stored"] == sum(lengths)
    assert sample["reserved_unused"] == sum(1024 - n for n in lengths)
    assert sample["internal_fragmentation"] == 0  # 1024 is whole blocks
    # Each finishes after 2 output tokens: n + 1 tokens stored at most.
    assert sample["reserved_never_used"] == sum(1024 - (n + 1) for n in lengths)
    assert sample["external_fragmentation"] == 0
    assert sample["free"] == 2 * 1024
    # A growing request moves slots from reserved to stored, one for one.
    running[0].num_computed_tokens += 1
    after = dict(zip(COLUMNS, contiguous_breakdown(kv, running, None), strict=True))
    assert after["stored"] == sample["stored"] + 1
    assert after["reserved_unused"] == sample["reserved_unused"] - 1


def test_contiguous_rounding_and_external_fragmentation() -> None:
    # 10 usable blocks; oracle reservations of 30+2=32 (2 blocks), 40+8=48 (3), 20+5=25 (2).
    kv = ContiguousKVManager("orca_oracle", 11, BLOCK_SIZE, max_model_len=1024)
    a, b, c = request("a", 30, 2), request("b", 40, 8), request("c", 20, 5)
    for req in (a, b, c):
        admit_computed(kv, req)
    kv.free(b)  # gaps: blocks 3-5 (3) and 8-10 (3)
    head = request("head", 60, 4)  # needs 4 blocks: neither gap serves it
    sample = dict(zip(COLUMNS, contiguous_breakdown(kv, [a, c], head), strict=True))
    assert sample["stored"] == 50
    assert sample["reserved_unused"] == 2 + 5
    assert sample["internal_fragmentation"] == 0 + (32 - 25)
    assert sample["reserved_never_used"] == (32 - 31) + (25 - 24)
    assert sample["external_fragmentation"] == 6 * BLOCK_SIZE
    assert sample["free"] == 0
    small = request("small", 20, 4)  # 2 blocks: every gap serves it
    sample = dict(zip(COLUMNS, contiguous_breakdown(kv, [a, c], small), strict=True))
    assert sample["external_fragmentation"] == 0
    assert sample["free"] == 6 * BLOCK_SIZE
    assert sum(sample[p] for p in PARTS) == 10 * BLOCK_SIZE
    big = request("big", 100, 12)  # 8 blocks: more than is free at all, so no fragmentation
    sample = dict(zip(COLUMNS, contiguous_breakdown(kv, [a, c], big), strict=True))
    assert sample["external_fragmentation"] == 0
    assert sample["free"] == 6 * BLOCK_SIZE


def test_time_weighting() -> None:
    def samples(*rows: tuple[int, ...]) -> dict[str, array]:
        return {name: array("q", [row[i] for row in rows]) for i, name in enumerate(COLUMNS)}

    # Capacity 100 slots; step 1 (1 s): 10 stored, 20 reserved, 70 free; step 2 (3 s): 50
    # stored, 10 internal, 5 held idle, 10 external, 25 free. A third sample has no duration
    # (cut off).
    one = samples(
        (10, 20, 0, 0, 0, 70, 5, 1), (50, 0, 10, 5, 10, 25, 0, 3), (99, 0, 0, 0, 0, 1, 0, 9)
    )
    out = kv_waste_breakdown("x", 100, [one], [[1.0, 3.0]])
    assert out["steps_time_s"] == 4.0
    assert out["effective_utilization"] == pytest.approx((10 * 1 + 50 * 3) / 400)
    assert out["shares_of_capacity"]["reserved_unused"] == pytest.approx(20 / 400)
    assert out["shares_of_capacity"]["internal_fragmentation"] == pytest.approx(30 / 400)
    assert out["shares_of_capacity"]["external_fragmentation"] == pytest.approx(30 / 400)
    assert out["shares_of_capacity"]["held_idle"] == pytest.approx(15 / 400)
    assert out["shares_of_capacity"]["free"] == pytest.approx((70 + 75) / 400)
    assert out["reserved_never_used_share"] == pytest.approx(5 / 400)
    assert out["stored_share_of_allocated"] == pytest.approx(160 / (160 + 20 + 30 + 15))
    assert out["mean_live_requests"] == pytest.approx((1 + 9) / 4)
    assert out["max_live_requests"] == 3
    # Two replicas: the shares are over both replicas' capacity-time.
    two = kv_waste_breakdown("x", 100, [one, one], [[1.0, 3.0], [1.0, 3.0]])
    assert two["effective_utilization"] == pytest.approx(out["effective_utilization"])
    assert two["steps_time_s"] == 8.0


def scenario(allocator: str = "paged") -> dict[str, Any]:
    return {
        "name": "waste",
        "seed": 11,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {"max_model_len": 2048, "allocator": allocator},
        "workload": {
            "kind": "agent_sessions",
            "sessions": 4,
            "session_arrival": {"kind": "poisson", "rate_per_s": 4.0},
            "turns": {"kind": "fixed", "value": 3},
            "system_prompt_tokens": 100,
            "tool_schema_tokens": 20,
            "user_message_tokens": {"kind": "fixed", "value": 30},
            "tool_result_tokens": {"kind": "uniform", "low": 10, "high": 80},
            "output_tokens": {"kind": "uniform", "low": 20, "high": 120},
            "tool_latency": {"kind": "fixed", "value_s": 0.2},
            "max_context_tokens": 2048,
        },
    }


def test_the_opt_in_changes_no_result_of_the_paged_run() -> None:
    spec = parse_scenario(scenario(), "waste")
    plain = simulate(spec)
    tracked = simulate(spec, kv_waste=True)
    assert "kv_waste_breakdown" not in plain.summary
    pd.testing.assert_frame_equal(plain.steps, tracked.steps, check_exact=True)
    pd.testing.assert_frame_equal(plain.requests, tracked.requests, check_exact=True)
    waste = tracked.summary.pop("kv_waste_breakdown")
    assert tracked.summary == plain.summary
    shares = waste["shares_of_capacity"]
    assert waste["allocator"] == "paged"
    assert shares["reserved_unused"] == shares["external_fragmentation"] == 0
    assert sum(shares.values()) == pytest.approx(1.0)
    assert 0 < shares["internal_fragmentation"] < waste["effective_utilization"]
    assert waste["steps_time_s"] == pytest.approx(plain.steps["duration_s"].sum())


def test_a_static_run_always_reports_its_waste() -> None:
    result = simulate(parse_scenario(scenario("static"), "waste-static"))
    waste = result.summary["kv_waste_breakdown"]
    shares = waste["shares_of_capacity"]
    assert waste["allocator"] == "static"
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["reserved_unused"] > 5 * shares["stored"]
    assert waste["reserved_never_used_share"] <= shares["reserved_unused"]
    assert shares["internal_fragmentation"] == 0
    assert result.summary["what_if"][0].startswith("engine.allocator=static")


def test_kvsim_run_kv_waste_writes_the_breakdown(tmp_path: Path) -> None:
    path = tmp_path / "waste.yaml"
    path.write_text(yaml.safe_dump(scenario()))
    args = ["run", str(path), "--quiet", "--set", "workload.sessions=2"]
    plain = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "plain")])
    tracked = CliRunner().invoke(app, [*args, "--kv-waste", "--out", str(tmp_path / "waste")])
    assert plain.exit_code == 0, plain.output
    assert tracked.exit_code == 0, tracked.output
    assert "kv_waste_breakdown" not in json.loads((tmp_path / "plain" / "summary.json").read_text())
    summary = json.loads((tmp_path / "waste" / "summary.json").read_text())
    assert summary["kv_waste_breakdown"]["allocator"] == "paged"
