"""Vidur-format operator tables of this GPU: one decoder layer's non-attention operators
timed per token count and tensor-parallel shard (torch only, no kvsim; runs as a file).

    python3 gpu_operators.py --out DIR [--device cuda] [--models all] [--tp 1,2,4,8]
                             [--repeats 5] [--budget-s 300] [--elementwise compiled|eager]

Writes ``DIR/compute/<gpu>/<org>/<model>/mlp.csv`` in the columns of Vidur's profiles
(``time_stats.<op>.{min,max,mean,median,std}`` in ms, the model's dimensions, ``num_tokens``,
``num_tensor_parallel_workers``), which ``kvsim calibrate --vidur DIR --gpu <gpu>`` reads;
``DIR/gemm_kernels.csv``: per GEMM point the kernel(s) the GEMM library ran; and
``DIR/meta.json``: the device, the library versions, how the element-wise operators ran.

What runs, as Vidur's profiler ran it (fp16, random weights, one layer of the model as one GPU
of a ``tp``-way group holds it): embedding gather, input RMSNorm (LayerNorm for phi-2), fused
QKV GEMM, rotary embedding (NeoX) of q and k, attention-output GEMM, post-attention norm,
fused gate/up GEMM, SiLU-and-mul (GELU for phi-2), down GEMM, residual add. Each pass runs the
operators in that order; after warm-up passes, ``--repeats`` passes are recorded with
``torch.profiler`` and each operator's time is the summed duration of the kernels it
launched (CUDA kernel time, as Vidur's tables hold; on a CPU the operator's CPU time, for
testing). The GEMMs are ``F.linear`` (cuBLAS), as in vLLM's unquantized linear layers.
Vidur ran the norms, RoPE and the activation as custom CUDA kernels; vLLM 0.32 by default lets
Inductor generate them (its custom ops are off under Inductor), so ``--elementwise compiled``
(the default on CUDA) compiles each with ``torch.compile``, only the token dimension dynamic:
one Triton kernel per operator and model shape. ``eager`` runs torch's own kernels (several
per norm). The layer is the same object pass after pass, so a TP shard small enough stays in
L2 between passes, in Vidur's tables too.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# org/name: (heads, kv_heads, hidden, intermediate, vocab, gated); Vidur's dimensions.
MODELS: dict[str, tuple[int, int, int, int, int, bool]] = {
    "meta-llama/Llama-2-7b-hf": (32, 32, 4096, 11008, 32768, True),
    "codellama/CodeLlama-34b-Instruct-hf": (64, 8, 8192, 22016, 32768, True),
    "Qwen/Qwen-72B": (64, 64, 8192, 24576, 152064, True),
    "microsoft/phi-2": (32, 32, 2560, 10240, 51200, False),
    "meta-llama/Meta-Llama-3-70B": (64, 8, 8192, 28672, 128256, True),
    "meta-llama/Llama-3.1-8B": (32, 8, 4096, 14336, 128256, True),
    # For --device cpu tests: seconds, not hours.
    "test/tiny": (4, 2, 64, 128, 256, True),
}
OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
STATS = ("min", "max", "mean", "median", "std")
DIMS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")


def vidur_token_counts(limit: int = 4096) -> list[int]:
    """Token counts up to ``limit`` (at most 4096): 1, 2, 4, every 8 to 1024, every 32 beyond;
    227 of the 259 in Vidur's tables (which also have every 16 from 1024 to 2048)."""
    counts = [1, 2, 4, *range(8, 1025, 8), *range(1056, min(limit, 4096) + 1, 32)]
    return [c for c in counts if c <= limit]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight


def _rope_neox(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [tokens, head_dim / 2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)

    return rotate(q), rotate(k)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_COMPILED: dict[str, Callable] = {}


def _compiled() -> dict[str, Callable]:
    """The element-wise operators compiled with only the token dimension dynamic: one kernel
    per model shape (hidden sizes, head counts static, as in vLLM's kernels), not one for
    every token count. All dimensions dynamic made kernels 4-7x slower than vLLM's (an RMSNorm
    of 8-256 tokens ~19 us on an H200, RoPE of 4096 tokens 570 us)."""
    if not _COMPILED:
        config = torch._dynamo.config
        config.automatic_dynamic_shapes = False  # a new model's sizes: a new static kernel
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(config, limit):
                setattr(config, limit, 512)
        for name, function, token_args in (
            ("rms_norm", _rms_norm, (0,)),
            ("rope", _rope_neox, (0, 1, 2)),
            ("silu_and_mul", _silu_and_mul, (0,)),
            ("gelu", _gelu, (0,)),
        ):
            _COMPILED[name] = _tokens_dynamic(torch.compile(function), token_args)
    return _COMPILED


def _tokens_dynamic(compiled: Callable, token_args: tuple[int, ...]) -> Callable:
    """``compiled`` with the first dimension of the arguments at ``token_args`` dynamic."""

    def call(*args: object) -> object:
        for index in token_args:
            torch._dynamo.maybe_mark_dynamic(args[index], 0)
        return compiled(*args)

    return call


def _check_compiled(device: torch.device) -> str | None:
    """Run each compiled operator once on a small input; the error if one fails."""
    try:
        fused = _compiled()
        x = torch.randn(3, 64, device=device, dtype=torch.float16)
        fused["rms_norm"](x, torch.ones(64, device=device, dtype=torch.float16))
        fused["silu_and_mul"](x)
        fused["gelu"](x)
        cos_sin = torch.randn(16, 16, device=device, dtype=torch.float16)
        positions = torch.arange(3, device=device)
        fused["rope"](x, x[:, :32], positions, cos_sin, 16)
    except Exception as exc:  # inductor needs a compiler toolchain: eager still measures
        _COMPILED.clear()
        return repr(exc)[:300]
    return None


class Layer:
    """One GPU's share of a decoder layer under ``tp``-way tensor parallelism."""

    def __init__(
        self, name: str, tp: int, device: torch.device, dtype: torch.dtype, compiled: bool
    ) -> None:
        heads, kv_heads, hidden, inter, vocab, gated = MODELS[name]
        self.name, self.tp, self.gated = name, tp, gated
        self.head_dim = hidden // heads
        self.q_width = heads // tp * self.head_dim
        self.kv_width = max(1, kv_heads // tp) * self.head_dim

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        self.embedding = weight(vocab // tp, hidden)
        self.norm_weight = torch.ones(hidden, device=device, dtype=dtype)
        self.norm_bias = torch.zeros(hidden, device=device, dtype=dtype)
        self.qkv = weight(self.q_width + 2 * self.kv_width, hidden)
        self.o = weight(hidden, self.q_width)
        self.up = weight((2 if gated else 1) * inter // tp, hidden)
        self.down = weight(hidden, inter // tp)
        self.cos_sin = torch.randn(8192, self.head_dim, device=device, dtype=dtype)
        fused = _compiled() if compiled else {}
        self.rms_norm = fused.get("rms_norm", _rms_norm)
        self.rope = fused.get("rope", _rope_neox)
        activation = "silu_and_mul" if gated else "gelu"
        self.act = fused.get(activation, _silu_and_mul if gated else _gelu)
        self.vocab, self.hidden, self.device = vocab // tp, hidden, device

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.rms_norm(x, self.norm_weight)
        return F.layer_norm(x, (self.hidden,), self.norm_weight, self.norm_bias)

    def operators(self, num_tokens: int) -> list[tuple[str, object]]:
        """The layer's operators for ``num_tokens`` tokens, as (name, thunk) in order."""
        ids = torch.randint(0, self.vocab, (num_tokens,), device=self.device)
        positions = torch.randint(0, 8192, (num_tokens,), device=self.device)
        state: dict[str, torch.Tensor] = {}

        def emb() -> None:
            state["x"] = F.embedding(ids, self.embedding)

        def qkv() -> None:
            state["qkv"] = F.linear(state["h"], self.qkv)

        def rope() -> None:
            q, k, _ = state["qkv"].split([self.q_width, self.kv_width, self.kv_width], dim=-1)
            state["q"], state["k"] = self.rope(q, k, positions, self.cos_sin, self.head_dim)

        def norm_in() -> None:
            state["h"] = self.norm(state["x"])

        def norm_post() -> None:
            state["h"] = self.norm(state["attn"])

        def o_proj() -> None:
            state["attn"] = F.linear(state["q"], self.o)

        def up() -> None:
            state["up"] = F.linear(state["h"], self.up)

        def act() -> None:
            state["act"] = self.act(state["up"])

        def down() -> None:
            state["down"] = F.linear(state["act"], self.down)

        def add() -> None:
            state["x"] = state["down"] + state["attn"]

        thunks = (emb, norm_in, qkv, rope, o_proj, norm_post, up, act, down, add)
        return list(zip(OPS, thunks, strict=True))


def time_layer(
    layer: Layer, counts: list[int], repeats: int, warmup: int, on_cuda: bool
) -> tuple[dict[tuple[int, str], list[float]], dict[tuple[int, str], str]]:
    """Each (token count, operator)'s times in ms over ``repeats`` recorded passes, and the
    kernel names of the first recorded pass."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for count in counts:
            plan = layer.operators(count)
            for _ in range(warmup):
                for _, thunk in plan:
                    thunk()
            for rep in range(repeats):
                for op, thunk in plan:
                    with torch.profiler.record_function(f"kvop|{count}|{op}|{rep}"):
                        thunk()
            del plan
        if on_cuda:
            torch.cuda.synchronize()
    found = attribute(prof.profiler.kineto_results.events(), on_cuda)
    return found if found is not None else _attribute_by_tree(prof)


def kernel_name(name: str) -> str:
    """A kernel's name without its template arguments and signature."""
    name = name.removeprefix("void ")
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    return name[:cut].strip()


def attribute(events: list, on_cuda: bool) -> tuple[dict, dict] | None:
    """Each range's times (ms) and first kernel names from kineto's raw events (building
    torch's event tree costs ~40 us an event: minutes a model). On CUDA a range also shows as
    a GPU-side annotation spanning its kernels: every other GPU event starting inside that
    span is its kernel; None if there are no such annotations. On a CPU: the range's time."""
    cpu = torch.autograd.DeviceType.CPU
    ranges = []  # (start_ns, end_ns, label) of the ranges on the timeline that counts
    others = []  # (start_ns, duration_ns, name) of GPU kernels, memsets, copies
    for event in events:
        name = event.name()
        on_gpu = event.device_type() != cpu
        if name.startswith("kvop|"):
            if on_gpu == on_cuda:
                ranges.append((event.start_ns(), event.end_ns(), name))
        elif on_gpu:
            others.append((event.start_ns(), event.duration_ns(), name))
    if on_cuda and not ranges:
        return None
    ranges.sort()
    others.sort()
    times: dict[tuple[int, str], list[float]] = {}
    kernels: dict[tuple[int, str], str] = {}
    index = 0
    for start, end, label in ranges:
        _, count, op, rep = label.split("|")
        key = (int(count), op)
        if not on_cuda:
            times.setdefault(key, []).append((end - start) / 1e6)
            continue
        while index < len(others) and others[index][0] < start:
            index += 1
        total, names = 0, []
        while index < len(others) and others[index][0] <= end:
            total += others[index][1]
            names.append(kernel_name(others[index][2]))
            index += 1
        times.setdefault(key, []).append(total / 1e6)
        if rep == "0":
            kernels[key] = "+".join(names)
    return times, kernels


def _attribute_by_tree(prof):
    """The slow way, where kineto gave no GPU-side ranges: torch's event tree."""
    times: dict[tuple[int, str], list[float]] = {}
    kernels: dict[tuple[int, str], str] = {}
    cpu = torch.autograd.DeviceType.CPU

    def names(event) -> list[str]:
        found = [kernel.name for kernel in event.kernels]
        for child in event.cpu_children:
            found.extend(names(child))
        return found

    for event in prof.events():
        if event.name.startswith("kvop|") and event.device_type == cpu:
            _, count, op, rep = event.name.split("|")
            key = (int(count), op)
            times.setdefault(key, []).append(event.device_time_total / 1000.0)
            if rep == "0":
                kernels[key] = "+".join(names(event))
    return times, kernels


def _stats(values: list[float]) -> list[float]:
    return [
        min(values),
        max(values),
        statistics.fmean(values),
        statistics.median(values),
        statistics.pstdev(values),
    ]


def write_table(path: Path, name: str, rows: list[tuple[int, int, dict[str, list[float]]]]) -> None:
    """Vidur's mlp.csv for one model: ``rows`` of (num_tokens, tp, times per operator)."""
    heads, kv_heads, hidden, inter, vocab, gated = MODELS[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    header = [f"time_stats.{op}.{stat}" for op in OPS for stat in STATS]
    header += [*DIMS, "num_tokens", "num_tensor_parallel_workers"]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for count, tp, by_op in rows:
            # ms to 10 ns: profiler durations are whole nanoseconds, kernels ~1 us and up
            cells = [round(value, 5) for op in OPS for value in _stats(by_op[op])]
            writer.writerow([*cells, heads, kv_heads, hidden, inter, vocab, gated, count, tp])


def gpu_folder_name(device: torch.device) -> str:
    """``h200`` for 'NVIDIA H200', ``cpu`` on a CPU: the tables' ``compute/<gpu>`` folder."""
    if device.type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).lower().replace("nvidia", "").split()
    return words[0] if words else "gpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="all", help="comma list of org/name, or all")
    parser.add_argument("--tp", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=300.0, help="no new model/TP after")
    parser.add_argument("--elementwise", choices=["compiled", "eager"], default=None)
    parser.add_argument("--gpu-name", default=None, help="folder name (default: from device)")
    args = parser.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device {args.device!r} must be 'cuda' or 'cpu'")
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.models == "all":
        names = [name for name in MODELS if name != "test/tiny"]
    else:
        names = args.models.split(",")
    for name in names:
        if name not in MODELS:
            parser.error(f"--models: unknown {name!r}; known: {', '.join(MODELS)}")
    try:
        degrees = [int(t) for t in args.tp.split(",")]
    except ValueError:
        parser.error(f"--tp {args.tp!r}: a comma list of TP degrees, e.g. 1,2,4,8")
    for option, value in (("--tp", min(degrees)), ("--max-tokens", args.max_tokens)):
        if value < 1:
            parser.error(f"{option} {value}: must be 1 or more")
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats {args.repeats} / --warmup {args.warmup}: need 1+ / 0+")
    elementwise = args.elementwise or ("compiled" if on_cuda else "eager")
    compile_error = _check_compiled(device) if elementwise == "compiled" else None
    if compile_error:
        print(f"torch.compile failed, element-wise operators run eagerly: {compile_error}")
        elementwise = f"eager (torch.compile failed: {compile_error})"
    gpu = args.gpu_name or gpu_folder_name(device)
    counts = vidur_token_counts(args.max_tokens)
    started = time.perf_counter()
    meta = {
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor(),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count
        if on_cuda
        else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "blas": str(torch.backends.cuda.preferred_blas_library()) if on_cuda else None,
        "python": sys.version.split()[0],
        "dtype": "float16",
        "elementwise": elementwise,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "token_counts": counts,
        "done": [],
        "skipped": [],
        "failed": [],
    }
    kernel_rows: list[list[object]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        rows: list[tuple[int, int, dict[str, list[float]]]] = []
        heads = MODELS[name][0]
        for tp in degrees:
            if heads % tp or (not MODELS[name][5] and tp > 1):
                continue  # phi-2: Vidur measured TP1 only
            if time.perf_counter() - started > args.budget_s:
                meta["skipped"].append(f"{name} tp{tp}")
                continue
            t0 = time.perf_counter()
            try:
                layer = Layer(name, tp, device, torch.float16, elementwise == "compiled")
                times, kernels = time_layer(layer, counts, args.repeats, args.warmup, on_cuda)
            except Exception as exc:  # one model's failure should not lose the others
                meta["failed"].append(f"{name} tp{tp}: {exc!r}"[:500])
                print(f"{name} tp{tp}: failed: {exc!r}", flush=True)
                continue
            for count in counts:
                rows.append((count, tp, {op: times[(count, op)] for op in OPS}))
                for op in GEMM_OPS:
                    median = statistics.median(times[(count, op)])
                    kernel_rows.append(
                        [name, tp, count, op, f"{median:.6f}", kernels.get((count, op), "")]
                    )
            del layer
            if on_cuda:
                torch.cuda.empty_cache()
            meta["done"].append(f"{name} tp{tp} ({time.perf_counter() - t0:.1f} s)")
            print(
                f"{name} tp{tp}: {len(counts)} token counts, {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            write_table(args.out / "compute" / gpu / name / "mlp.csv", name, rows)
            with (args.out / "gemm_kernels.csv").open("w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(["model", "tp", "num_tokens", "op", "median_ms", "kernels"])
                writer.writerows(kernel_rows)
            _write_meta(args.out, meta, started)
    _write_meta(args.out, meta, started)  # also what was skipped or failed after the last
    return 0 if meta["done"] else 1


def _write_meta(out: Path, meta: dict, started: float) -> None:
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
