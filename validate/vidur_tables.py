"""Read Vidur-format GPU operator profiles into tidy tables.

Layout (Vidur's ``data/profiling/``; the subset in the repository's shared data)::

    ROOT/compute/<gpu>/<org>/<model>/mlp.csv      non-attention operators of one layer
    ROOT/network/<gpu>_dgx/all_reduce.csv         NCCL all-reduce by message size and GPUs

``mlp.csv`` has ``time_stats.<op>.median`` in milliseconds per operator, the model's dimensions
(``n_head``, ``n_kv_head``, ``n_embd``, ``n_expanded_embd``, ``vocab_size``, ``use_gated_mlp``),
``num_tokens`` and ``num_tensor_parallel_workers``; ``all_reduce.csv`` has
``time_stats.all_reduce.median`` (ms), ``size`` (bytes), ``num_workers`` and
``devices_per_node``. Repeated measurements of one point are reduced to their median.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sim.errors import KvsimConfigError
from sim.gpu_kernels import LayerShape

SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
POINT_COLUMNS = ("num_tokens", "num_tensor_parallel_workers")
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
EMBEDDING_OP = "emb"
# Every operator a fit needs: the GEMMs and one column of each element-wise kind (the
# post-attention norm is optional: phi-2 has none).
REQUIRED_OPS = (*GEMM_OPS, "input_layernorm", "attn_rope", "mlp_act", "add", EMBEDDING_OP)
MS = 1e-3


@dataclass(frozen=True)
class OperatorTables:
    """One GPU's measurements: ``layers`` has one row per (model, num_tokens, tp) with each
    operator's median seconds in a column named after it; ``allreduce`` one row per
    (tensor_parallel_size, bytes) with ``time_s``."""

    gpu: str
    layers: pd.DataFrame
    allreduce: pd.DataFrame

    @property
    def models(self) -> list[str]:
        return sorted(self.layers["model"].unique())


def layer_shape(row: pd.Series) -> LayerShape:
    """The :class:`LayerShape` of a ``layers`` row (fp16 profiles: 2 bytes per value)."""
    hidden, heads = int(row["n_embd"]), int(row["n_head"])
    return LayerShape(
        hidden=hidden,
        q_heads=heads,
        kv_heads=int(row["n_kv_head"]),
        head_dim=hidden // heads,
        intermediate=int(row["n_expanded_embd"]),
        gated=bool(row["use_gated_mlp"]),
        vocab=int(row["vocab_size"]),
        tp=int(row["num_tensor_parallel_workers"]),
    )


def _read_csv(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise KvsimConfigError(f"cannot read operator table {path}: {exc}") from exc
    missing = [column for column in required if column not in frame.columns]
    if missing:
        raise KvsimConfigError(
            f"operator table {path} lacks column(s) {', '.join(missing)}: not a Vidur profile"
        )
    return frame


def _check_numbers(
    frame: pd.DataFrame, path: Path, positive_ints: tuple[str, ...], times: tuple[str, ...]
) -> None:
    """Dimensions must be positive integers and times positive and finite; the first bad
    value is named with its file, column and row."""
    for column in (*positive_ints, *times):
        values = pd.to_numeric(frame[column], errors="coerce")
        if column in positive_ints:
            bad = values.isna() | (values <= 0) | (values != values.round())
            what = "a positive integer"
        else:
            bad = frame[column].notna() & ~(np.isfinite(values) & (values > 0))
            what = "a positive, finite time in ms"
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            value = frame[column].iloc[row]
            value = value.item() if isinstance(value, np.generic) else value
            raise KvsimConfigError(
                f"operator table {path}, column {column}, row {row + 2}: {value!r} is not {what}"
            )


def read_layers(root: Path, gpu: str) -> pd.DataFrame:
    """Every model's ``mlp.csv`` under ``root/compute/<gpu>`` as one frame (seconds)."""
    files = sorted((root / "compute" / gpu).glob("*/*/mlp.csv"))
    if not files:
        known = sorted(p.name for p in (root / "compute").glob("*") if p.is_dir())
        raise KvsimConfigError(
            f"--gpu {gpu!r}: no {root}/compute/{gpu}/<org>/<model>/mlp.csv; "
            f"GPUs there: {', '.join(known) or 'none'}"
        )
    frames = []
    for path in files:
        required = [f"time_stats.{op}.median" for op in REQUIRED_OPS]
        frame = _read_csv(path, (*SHAPE_COLUMNS, *POINT_COLUMNS, *required))
        ops = [
            op
            for op in (*GEMM_OPS, *ELEMENTWISE_OPS, EMBEDDING_OP)
            if f"time_stats.{op}.median" in frame.columns
        ]
        dims = tuple(c for c in (*SHAPE_COLUMNS, *POINT_COLUMNS) if c != "use_gated_mlp")
        _check_numbers(frame, path, dims, tuple(f"time_stats.{op}.median" for op in ops))
        for column in required:
            if frame[column].isna().any():
                raise KvsimConfigError(f"operator table {path}: column {column} has empty cells")
        tidy = frame[[*SHAPE_COLUMNS, *POINT_COLUMNS]].copy()
        for op in ops:
            tidy[op] = frame[f"time_stats.{op}.median"] * MS
        tidy.insert(0, "model", path.parent.name)
        frames.append(
            tidy.groupby(["model", *SHAPE_COLUMNS, *POINT_COLUMNS], as_index=False).median()
        )
    return pd.concat(frames, ignore_index=True)


def read_allreduce(root: Path, gpu: str) -> pd.DataFrame:
    """All-reduce medians within one node (``devices_per_node == num_workers``), seconds."""
    path = root / "network" / f"{gpu}_dgx" / "all_reduce.csv"
    if not path.exists():
        return pd.DataFrame(columns=["tensor_parallel_size", "bytes", "time_s"])
    frame = _read_csv(
        path, ("time_stats.all_reduce.median", "size", "num_workers", "devices_per_node")
    )
    _check_numbers(
        frame,
        path,
        ("size", "num_workers", "devices_per_node"),
        ("time_stats.all_reduce.median",),
    )
    frame = frame[frame["devices_per_node"] == frame["num_workers"]]
    tidy = pd.DataFrame(
        {
            "tensor_parallel_size": frame["num_workers"].astype(int),
            "bytes": frame["size"].astype(float),
            "time_s": frame["time_stats.all_reduce.median"] * MS,
        }
    )
    return tidy.groupby(["tensor_parallel_size", "bytes"], as_index=False).median()


def read_tables(root: str | Path, gpu: str) -> OperatorTables:
    """One GPU's operator and all-reduce tables from a Vidur profiling folder."""
    root = Path(root)
    if not root.is_dir():
        raise KvsimConfigError(f"--vidur {root}: no such folder")
    if not (root / "compute").is_dir():
        raise KvsimConfigError(
            f"--vidur {root}: no compute/ folder; expected Vidur's data/profiling layout "
            "(compute/<gpu>/<org>/<model>/mlp.csv, network/<gpu>_dgx/all_reduce.csv)"
        )
    return OperatorTables(gpu, read_layers(root, gpu), read_allreduce(root, gpu))
