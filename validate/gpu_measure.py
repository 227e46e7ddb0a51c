"""Step times of a real decoder stack on a GPU: the measuring half of ``validate/gpu_profile.py``.

torch and the standard library only (nothing from kvsim), so it can be copied onto a GPU box
together with its sibling ``gpu_stack.py``, the decoder stack it times. It builds the decoder-layer
stack of a model geometry (Llama-3.1-8B by default) with random weights made on the device, and
times engine-like steps over a grid of batch compositions: prefill chunks at several contexts,
decode batches at several contexts, mixed chunked-prefill batches. Each step is one forward
pass of the stack (see ``gpu_stack.py``), timed with CUDA events (medians after warm-ups),
eagerly and replayed as a CUDA graph. It also measures device copy bandwidth, the bf16 matmul
rate and pinned host<->device bandwidth::

    python3 validate/gpu_measure.py --out raw.json [--geometry llama-3.1-8b|tiny]
                                    [--device cuda|cpu] [--quick] [--budget-s S]

``python -m validate.gpu_profile measure ...`` runs the same. The raw JSON it writes is what
``validate/gpu_profile.py`` merges, fits and compares.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

if __package__:
    from .gpu_stack import SPLIT_MODES, DecoderStack, self_test_paged, self_test_split
else:  # run as a file (python3 gpu_measure.py): its sibling, copied beside it
    from gpu_stack import SPLIT_MODES, DecoderStack, self_test_paged, self_test_split

RAW_FORMAT = "kvsim-gpu-step-profile/1"

# Geometries the measuring half can build. Llama-3.1-8B matches sim.config.model's preset.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "name": "Llama-3.1-8B",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
    },
    "tiny": {
        "name": "tiny-torch",
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "vocab_size": 512,
        "rope_theta": 10000.0,
    },
}

# Grids: (chunk tokens, context before the chunk) for prefill; (requests, context) for decode;
# mixed = one or more prefill chunks plus a decode batch in one step.
GRIDS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "prefill_chunks": [128, 256, 512, 1024, 2048, 4096, 8192],
        "prefill_contexts": [0, 2048, 8192, 32768],
        "decode_batches": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        "decode_contexts": [512, 2048, 8192, 32768],
        # (prefill reqs, chunk, prefill context, decode reqs, decode context)
        "mixed": [
            (1, c, pctx, d, 2048)
            for c in (256, 1024, 4096)
            for pctx in (0, 16384)
            for d in (8, 64, 256)
        ]
        + [(4, 512, 0, 0, 0), (8, 256, 4096, 0, 0), (2, 2048, 0, 0, 0), (16, 128, 1024, 0, 0)]
        + [(2, 1024, 4096, 64, 4096)],
        "coarse": {128, 512, 2048, 8192, 0, 32768, 1, 16, 64, 256, 8},
    },
    "tiny": {
        "prefill_chunks": [16, 64, 256],
        "prefill_contexts": [0, 256],
        "decode_batches": [1, 4, 16],
        "decode_contexts": [64, 256],
        "mixed": [(1, 64, 0, 4, 64), (1, 16, 256, 16, 256), (2, 32, 0, 0, 0)],
        "coarse": {16, 256, 0, 1, 64},
    },
}


class MeasureError(Exception):
    """Bad arguments to ``measure``; printed as one paragraph, exit status 2."""


def _timer(torch: Any, device: Any):
    """A function ``time_fn(fn, reps) -> list of seconds``: CUDA events on a GPU, else wall."""

    if device.type == "cuda":

        def time_cuda(fn: Any, reps: int) -> list[float]:
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(reps)
            ]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in events]

        return time_cuda

    def time_wall(fn: Any, reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    return time_wall


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _micro_benchmarks(torch: Any, device: Any, quick: bool) -> dict[str, float]:
    """Device copy bandwidth (read + write bytes), bf16 matmul FLOP/s, pinned H2D/D2H."""
    time_fn = _timer(torch, device)
    out: dict[str, float] = {}
    gpu = device.type == "cuda"
    nbytes = (1 << 30) if gpu and not quick else (16 << 20)
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    time_fn(partial(dst.copy_, src), 3)
    copy_s = statistics.median(time_fn(partial(dst.copy_, src), 10))
    out["device_copy_bytes_per_s"] = 2 * nbytes / copy_s  # each byte is read and written
    del src, dst
    n = 8192 if gpu and not quick else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    time_fn(partial(torch.matmul, a, b), 3)
    mm_s = statistics.median(time_fn(partial(torch.matmul, a, b), 10))
    out["bf16_matmul_flops_per_s"] = 2 * n**3 / mm_s
    out["bf16_matmul_size"] = float(n)
    del a, b
    if gpu:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.fill_(7)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        h2d = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
        d2h = lambda: host.copy_(dev, non_blocking=True)  # noqa: E731
        time_fn(h2d, 2)
        out["h2d_pinned_bytes_per_s"] = nbytes / statistics.median(time_fn(h2d, 5))
        time_fn(d2h, 2)
        out["d2h_pinned_bytes_per_s"] = nbytes / statistics.median(time_fn(d2h, 5))
        out["host_copy_bytes"] = float(nbytes)
        del host, dev
    out["device_copy_bytes"] = float(nbytes)
    return out


def _grid_points(geometry_key: str) -> list[dict[str, int]]:
    """The grid in measuring order: the coarse points of every regime first, then the rest,
    so a run cut short by its time budget still spans every regime."""
    grid = GRIDS[geometry_key]
    coarse = grid["coarse"]
    points: list[tuple[int, dict[str, int]]] = []

    def add(regime: str, n_pre: int, chunk: int, pctx: int, n_dec: int, dctx: int) -> None:
        keys = [v for v in (chunk, pctx, n_dec, dctx) if v]
        tier = 0 if all(v in coarse for v in keys) else 1
        point = {
            "num_prefill_reqs": n_pre,
            "chunk_tokens": chunk if n_pre else 0,
            "prefill_context_tokens": pctx if n_pre else 0,
            "num_decode_reqs": n_dec,
            "decode_context_tokens": dctx if n_dec else 0,
        }
        points.append((tier, {"regime": regime, **point}))  # type: ignore[dict-item]

    for chunk in grid["prefill_chunks"]:
        for ctx in grid["prefill_contexts"]:
            add("prefill", 1, chunk, ctx, 0, 0)
    for n in grid["decode_batches"]:
        for ctx in grid["decode_contexts"]:
            add("decode", 0, 0, 0, n, ctx)
    for n_pre, chunk, pctx, n_dec, dctx in grid["mixed"]:
        add("mixed" if n_dec else "prefill", n_pre, chunk, pctx, n_dec, dctx)
    points.sort(key=lambda tp: tp[0])  # stable: keeps the regime order within a tier
    return [p for _, p in points]


def batch_shape_fields(point: dict[str, int]) -> dict[str, float]:
    """The BatchShape (sim.scheduler.output) of a grid point, as kvsim's scheduler counts it:
    a decode at context n attends n computed tokens plus its own; a chunk of c tokens after n
    computes c (n + c / 2) query-key pairs."""
    n_pre, chunk = point["num_prefill_reqs"], point["chunk_tokens"]
    pctx = point["prefill_context_tokens"]
    n_dec, dctx = point["num_decode_reqs"], point["decode_context_tokens"]
    return {
        "num_prefill_tokens": n_pre * chunk,
        "num_prefill_reqs": n_pre,
        "prefill_attention_pairs": float(n_pre * chunk * (pctx + chunk / 2)),
        "num_decode_reqs": n_dec,
        "decode_context_tokens": n_dec * dctx,
    }


def _time_point(
    stack: DecoderStack,
    batch: dict[str, Any],
    paged: bool,
    time_fn: Any,
    target_s: float,
    max_reps: int,
    use_graph: bool,
) -> dict[str, Any]:
    """Eager median, then (on a GPU, for steps short enough that launches matter) the median
    of CUDA-graph replays; ``median_s`` is the graph time when there is one."""
    torch = stack.torch
    with torch.inference_mode():
        run = lambda: stack.step(batch, paged)  # noqa: E731
        warm = time_fn(run, 2)
        reps = int(min(max_reps, max(3, target_s / max(min(warm), 1e-6))))
        eager = time_fn(run, reps)
        result: dict[str, Any] = {
            "eager_median_s": statistics.median(eager),
            "eager_min_s": min(eager),
            "eager_max_s": max(eager),
            "reps": reps,
        }
        result["median_s"] = result["eager_median_s"]
        if use_graph and result["eager_median_s"] < 0.1:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    run()
                    run()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                time_fn(graph.replay, 2)
                replays = time_fn(graph.replay, reps)
                result["graph_median_s"] = statistics.median(replays)
                result["graph_min_s"] = min(replays)
                result["median_s"] = result["graph_median_s"]
                del graph
            except Exception as exc:  # a capture failure leaves the eager time standing
                result["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
    return result


def _environment(torch: Any, device: Any) -> dict[str, str]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device_type": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = str(torch.version.cuda)
        env["total_memory_bytes"] = str(props.total_memory)
        env["total_memory_mib"] = str(props.total_memory // (1 << 20))
        env["multiprocessors"] = str(props.multi_processor_count)
        env["capability"] = f"{props.major}.{props.minor}"
        env["cudnn"] = str(torch.backends.cudnn.version())
        try:
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
            env["driver"] = env["nvidia_smi"].split(",")[0].strip()
        except (OSError, subprocess.SubprocessError) as exc:
            env["driver"] = f"unknown ({exc})"
    else:
        env["device_name"] = f"cpu: {platform.processor() or platform.machine()}"
        env["cpu_threads"] = str(torch.get_num_threads())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    return env


def measure(
    out: Path,
    geometry_key: str = "llama-3.1-8b",
    device_name: str = "cuda",
    quick: bool = False,
    budget_s: float = 330.0,
    split_kv: str = "auto",
    reserve_bytes: int = 24 << 30,
) -> dict[str, Any]:
    """Measure the grid and write the raw JSON to ``out`` (rewritten after every point, so a
    run cut short still leaves its measurements); returns the raw record."""
    t_start = time.perf_counter()
    if geometry_key not in GEOMETRIES:
        raise MeasureError(
            f"--geometry {geometry_key!r} is not known; choose one of {', '.join(GEOMETRIES)}"
        )
    if device_name not in ("cuda", "cpu"):
        raise MeasureError(f"--device {device_name!r} must be 'cuda' or 'cpu'")
    if not budget_s > 0:
        raise MeasureError(f"--budget-s {budget_s} must be > 0 seconds")
    if split_kv not in SPLIT_MODES:
        raise MeasureError(f"--split-kv {split_kv!r} must be one of {', '.join(SPLIT_MODES)}")
    import torch

    if device_name == "cuda" and not torch.cuda.is_available():
        raise MeasureError("--device cuda: torch sees no CUDA device; use --device cpu")
    device = torch.device(device_name)
    torch.manual_seed(0)
    geometry = dict(GEOMETRIES[geometry_key])
    gpu = device.type == "cuda"
    page = 256 if gpu else 16  # FlashAttention-2's paged KV wants pages of 256 tokens
    print(f"[measure] torch {torch.__version__} on {device}", flush=True)
    env = _environment(torch, device)
    micro = _micro_benchmarks(torch, device, quick)
    if gpu:
        torch.cuda.empty_cache()  # hand the micro-benchmarks' buffers back before sizing KV
    print(f"[measure] micro-benchmarks: {json.dumps(micro)}", flush=True)

    g = geometry
    kv_bytes_per_token = 2 * g["num_hidden_layers"] * g["num_key_value_heads"] * g["head_dim"] * 2
    weight_bytes = 2 * (
        2 * g["vocab_size"] * g["hidden_size"]
        + g["num_hidden_layers"]
        * (
            (g["num_attention_heads"] + 2 * g["num_key_value_heads"])
            * g["head_dim"]
            * g["hidden_size"]
            + g["hidden_size"] * g["num_attention_heads"] * g["head_dim"]
            + 3 * g["intermediate_size"] * g["hidden_size"]
        )
    )
    points = _grid_points(geometry_key)
    needed_tokens = max(
        p["num_prefill_reqs"] * (p["prefill_context_tokens"] + p["chunk_tokens"] + page)
        + p["num_decode_reqs"] * (p["decode_context_tokens"] + 1 + page)
        for p in points
    )
    if gpu:
        free_bytes, _ = torch.cuda.mem_get_info(device)
        kv_budget = free_bytes - weight_bytes - reserve_bytes
        kv_tokens = max(page, min(needed_tokens, kv_budget // kv_bytes_per_token))
    else:
        kv_tokens = min(needed_tokens, 1 << 16)
    print(f"[measure] KV pool {kv_tokens} tokens ({kv_bytes_per_token} B/token)", flush=True)
    stack = DecoderStack(torch, geometry, device, kv_tokens, page)
    _sync(torch, device)
    geometry["num_params"] = stack.num_params
    geometry["dtype"] = "bfloat16"
    paged_problem = self_test_paged(stack) if gpu else "no paged kernel on the CPU"
    paged = paged_problem is None
    stack.split_mode = split_kv
    split_problem = self_test_split(stack) if split_kv != "off" else None
    if split_problem is not None:
        stack.split_mode = "off"
    attention = {
        "path": "flash-varlen-paged" if paged else "sdpa",
        "page_tokens": page,
        "paged_call": {k: str(v) for k, v in stack.paged_call.items()} if paged else {},
        "split_kv": (
            f"{split_kv}: tiles target {stack.split_target} (request x KV head x split)"
            if split_problem is None
            else f"off: {split_problem}"
        ),
        "note": (
            "one torch.nn.attention.varlen.varlen_attn (FlashAttention-2) call per layer over "
            "the whole batch, KV read through a block table from a paged pool (pages handed "
            "out in random order), like vLLM's FLASH_ATTN backend"
            if paged
            else "torch SDPA per phase: prefill chunks with lower-right causal masks "
            "(FlashAttention-2), decodes batched with query heads grouped per KV head, "
            "split-KV over the context when few requests would leave SMs idle, KV read as "
            f"strided views of consecutive pages (paged kernel not used: {paged_problem})"
        ),
    }
    print(
        f"[measure] attention: {attention['path']}, split-KV {attention['split_kv']} "
        f"({attention['note']})",
        flush=True,
    )
    time_fn = _timer(torch, device)
    raw: dict[str, Any] = {
        "format": RAW_FORMAT,
        "geometry_key": geometry_key,
        "geometry": geometry,
        "environment": env,
        "attention": attention,
        "timing": {
            "method": "cuda events" if gpu else "time.perf_counter",
            "statistic": "median",
            "cuda_graphs": gpu,
            "quick": quick,
        },
        "micro": micro,
        "kv_pool_tokens": stack.num_pages * page,
        "kv_bytes_per_token": kv_bytes_per_token,
        "budget_s": budget_s,
        "steps": [],
        "skipped": [],
        "failed": [],
    }
    target_s = 0.05 if quick else (0.3 if gpu else 0.1)
    max_reps = 5 if quick else 15
    setup_s = time.perf_counter() - t_start
    last_cost_s = 0.0
    for index, point in enumerate(points):
        elapsed = time.perf_counter() - t_start
        # Stop adding points while the output can still be written inside the budget.
        if elapsed + 2 * last_cost_s > budget_s:
            for rest in points[index:]:
                raw["skipped"].append({**rest, "reason": "time budget spent"})
            break
        need = (
            stack.pages_for(point["prefill_context_tokens"] + point["chunk_tokens"])
            * point["num_prefill_reqs"]
            + stack.pages_for(point["decode_context_tokens"] + 1) * point["num_decode_reqs"]
        )
        if need > stack.num_pages:
            raw["skipped"].append(
                {
                    **point,
                    "reason": f"KV needs {need * page} tokens, pool holds "
                    f"{stack.num_pages * page} ({kv_bytes_per_token} B/token)",
                }
            )
            continue
        t0 = time.perf_counter()
        try:
            batch = stack.build_batch(point, paged)
            timing = _time_point(stack, batch, paged, time_fn, target_s, max_reps, gpu)
        except Exception as exc:
            raw["failed"].append({**point, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"[measure] FAILED {point}: {exc}", flush=True)
            if gpu:
                try:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except Exception as sync_exc:  # a sticky CUDA error: later points fail too
                    print(f"[measure] CUDA unusable after the failure: {sync_exc}", flush=True)
            continue
        finally:
            last_cost_s = time.perf_counter() - t0
        prefill_splits, decode_splits = (1, 1) if paged else stack.splits_for(point)
        step = {
            **point,
            "decode_context_per_req": point["decode_context_tokens"],
            **batch_shape_fields(point),  # decode_context_tokens becomes the batch's sum
            **timing,
            "prefill_kv_splits": prefill_splits,
            "decode_kv_splits": decode_splits,
        }
        raw["steps"].append(step)
        print(
            f"[measure] {len(raw['steps']):3d} {point['regime']:7s} pre {point['num_prefill_reqs']}"
            f"x{point['chunk_tokens']}@{point['prefill_context_tokens']} dec "
            f"{point['num_decode_reqs']}@{point['decode_context_tokens']}: "
            f"{1e3 * step['median_s']:.3f} ms (eager {1e3 * step['eager_median_s']:.3f}) "
            f"[{time.perf_counter() - t_start:.0f} s]",
            flush=True,
        )
        if gpu:
            del batch
            torch.cuda.empty_cache()
        raw["elapsed_s"] = time.perf_counter() - t_start
        write_json(out, raw)
    raw["setup_s"] = setup_s
    raw["elapsed_s"] = time.perf_counter() - t_start
    raw["complete"] = not raw["skipped"] or all(
        s["reason"] != "time budget spent" for s in raw["skipped"]
    )
    write_json(out, raw)
    print(
        f"[measure] wrote {out}: {len(raw['steps'])} steps, {len(raw['skipped'])} skipped, "
        f"{len(raw['failed'])} failed in {raw['elapsed_s']:.0f} s",
        flush=True,
    )
    return raw


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 validate/gpu_measure.py",
        description="Time steps of a random-weight decoder stack (torch).",
    )
    parser.add_argument("--out", required=True, type=Path, help="raw JSON to write")
    parser.add_argument("--geometry", default="llama-3.1-8b", help=", ".join(GEOMETRIES))
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--quick", action="store_true", help="small micro-benchmarks, few reps")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop adding points after")
    parser.add_argument(
        "--split-kv", default="auto", help="split-KV attention: " + ", ".join(SPLIT_MODES)
    )
    args = parser.parse_args(argv)
    try:
        measure(args.out, args.geometry, args.device, args.quick, args.budget_s, args.split_kv)
    except MeasureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
