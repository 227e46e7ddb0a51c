"""How this GPU's power cap slows sustained GEMMs (torch only, no kvsim; runs as a file).

    python3 gpu_power.py --out FILE.json [--device cuda] [--cool-s 0.5] [--trials 3]

The kernel model (``sim/gpu_kernels.py``) prices a compute-bound GEMM slower per FLOP the
longer it runs: a GPU that keeps its tensor cores busy reaches its board power limit and
lowers its clock. This script measures that sag directly, on fp16 GEMMs (``torch.mm``, the
cuBLAS GEMM that ``F.linear`` without a bias runs, as vLLM's unquantized linear layers do),
each started after ``--cool-s`` seconds idle:

- ``sag`` (``--sag shape:tokens:count,...``): ``count`` copies of one GEMM back to back,
  each timed with CUDA events; per copy the median over ``--trials`` cool starts. Kernel
  time against the compute done before it shows how fast and how far the clock sags.
- ``length``: one GEMM of M tokens (M doubling) timed alone from a cool start, and the same
  GEMM's time once sustained (back to back for ~``--sustain-s``, the median of the last
  fifth), with the SM clock and board power read (NVML through torch, when present) at the
  end of the sustained run.

On a CPU (for testing) the times are wall-clock and there is no clock or power to read.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# name: (K, N): GEMM shapes of Vidur's models at TP1 (Qwen-72B's gate/up and QKV, Llama-2-7B's
# gate/up), and a tiny one for CPU tests.
SHAPES: dict[str, tuple[int, int]] = {
    "qwen-72b-up": (8192, 49152),
    "qwen-72b-qkv": (8192, 24576),
    "llama-2-7b-up": (4096, 22016),
    "test-tiny": (64, 128),
}
# (shape, tokens, chain length) of the sag chains: ~0.3, ~1.2 and ~5 ms kernels on an H200,
# 0.2-0.5 s of compute each.
SAG_CHAINS = (("qwen-72b-up", 256, 600), ("qwen-72b-up", 1024, 250), ("qwen-72b-up", 4096, 100))
LENGTH_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Timer:
    """Times a callable per call: CUDA events on a GPU, wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def chain(self, fn: Callable[[], None], count: int) -> list[float]:
        """Seconds of each of ``count`` calls of ``fn`` run back to back."""
        if not self.cuda:
            times = []
            for _ in range(count):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return times
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        events[0].record()
        for i in range(count):
            fn()
            events[i + 1].record()
        torch.cuda.synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(count)]


def read_clock_and_power(device: torch.device) -> dict[str, float | None]:
    """The SM clock (MHz) and board power (W) now, or None where NVML is not available."""
    out: dict[str, float | None] = {"clock_mhz": None, "power_w": None}
    if device.type != "cuda":
        return out
    try:
        out["clock_mhz"] = float(torch.cuda.clock_rate(device))
        out["power_w"] = float(torch.cuda.power_draw(device)) / 1e3
    except Exception:  # NVML missing or unsupported: the times still stand
        pass
    return out


def gemm(device: torch.device, m: int, k: int, n: int) -> Callable[[], None]:
    """A closure running one ``m`` x ``k`` -> ``n`` fp16 GEMM (fp32 on a CPU)."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    a = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)

    def run() -> None:
        torch.mm(a, w.t(), out=out)  # what F.linear without a bias runs: one cuBLAS GEMM

    return run


def measure_sag(
    device: torch.device, timer: Timer, shape: str, m: int, count: int, cool_s: float, trials: int
) -> dict:
    k, n = SHAPES[shape]
    fn = gemm(device, m, k, n)
    timer.chain(fn, 3)  # the library's kernel choice and workspace, before the first cool-down
    runs, starts = [], []
    for _ in range(trials):
        timer.sync()
        time.sleep(cool_s)
        starts.append(time.time())
        runs.append(timer.chain(fn, count))
    times = [statistics.median(run[i] for run in runs) for i in range(count)]
    return {"shape": shape, "m": m, "k": k, "n": n, "started": starts, "times_s": times}


def measure_length(
    device: torch.device,
    timer: Timer,
    shape: str,
    m: int,
    cool_s: float,
    trials: int,
    sustain_s: float,
) -> dict:
    k, n = SHAPES[shape]
    fn = gemm(device, m, k, n)
    first = timer.chain(fn, 3)[-1]
    cool = []
    for _ in range(trials):
        timer.sync()
        time.sleep(cool_s)
        cool.append(timer.chain(fn, 1)[0])
    timer.sync()
    time.sleep(cool_s)
    count = max(10, min(2000, round(sustain_s / max(first, 1e-6))))
    sustained = timer.chain(fn, count)
    reading = read_clock_and_power(device)
    return {
        "shape": shape,
        "m": m,
        "k": k,
        "n": n,
        "flops": 2.0 * m * k * n,
        "cool_s": statistics.median(cool),
        "sustained_s": statistics.median(sustained[-max(1, count // 5) :]),
        "sustained_count": count,
        **reading,
    }


def _positive_ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: a comma list of whole numbers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: each must be 1 or more")
    return values


def _checked(args: argparse.Namespace) -> tuple[torch.device, list[str], list[int], list]:
    """The run's device, shapes, token counts and sag chains; ValueError naming the flag."""
    if args.device not in ("cuda", "cpu"):
        raise ValueError(f"--device {args.device!r} must be 'cuda' or 'cpu'")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        raise ValueError(
            f"--shapes: unknown {unknown or args.shapes!r}; known: {', '.join(SHAPES)}"
        )
    tokens = _positive_ints("--tokens", args.tokens)
    chains: list[tuple[str, int, int]] = []
    if args.sag == "default":
        chains = list(SAG_CHAINS)
    elif args.sag != "none":
        for item in args.sag.split(","):
            parts = item.split(":")
            if len(parts) != 3 or parts[0] not in SHAPES:
                raise ValueError(
                    f"--sag {item!r}: shape:tokens:count with a shape of {', '.join(SHAPES)}"
                )
            if not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
                raise ValueError(f"--sag {item!r}: tokens and count must be whole numbers >= 1")
            chains.append((parts[0], int(parts[1]), int(parts[2])))
    if args.cool_s < 0 or args.trials < 1 or args.sustain_s <= 0:
        raise ValueError(
            f"--cool-s {args.cool_s} / --trials {args.trials} / --sustain-s {args.sustain_s}: "
            "need >= 0 / 1 or more / > 0"
        )
    return torch.device(args.device), shapes, tokens, chains


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cool-s", type=float, default=0.5, help="idle before each start")
    parser.add_argument("--trials", type=int, default=3, help="cool starts per point")
    parser.add_argument("--sustain-s", type=float, default=0.3, help="sustained run length")
    parser.add_argument("--shapes", default="qwen-72b-up,qwen-72b-qkv,llama-2-7b-up")
    parser.add_argument("--tokens", default=",".join(map(str, LENGTH_TOKENS)))
    parser.add_argument("--sag", default="default", help="'default', 'none' or shape:m:count,...")
    args = parser.parse_args(argv)
    try:
        device, shapes, tokens, chains = _checked(args)
    except ValueError as err:
        print(f"gpu_power: {err}", file=sys.stderr)
        return 2
    timer = Timer(device)
    started = time.time()
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cool_s": args.cool_s,
        "trials": args.trials,
        "idle": read_clock_and_power(device),
        "sag": [],
        "length": [],
    }
    for shape, m, count in chains:
        result["sag"].append(measure_sag(device, timer, shape, m, count, args.cool_s, args.trials))
        print(f"sag {shape} m={m}: {count} kernels", flush=True)
    for shape in shapes:
        for m in tokens:
            point = measure_length(
                device, timer, shape, m, args.cool_s, args.trials, args.sustain_s
            )
            result["length"].append(point)
            print(
                f"length {shape} m={m}: cool {point['cool_s'] * 1e3:.3f} ms, sustained "
                f"{point['sustained_s'] * 1e3:.3f} ms, clock {point['clock_mhz']}, "
                f"power {point['power_w']}",
                flush=True,
            )
    result["wall_s"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
