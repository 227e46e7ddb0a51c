"""Step times of a real decoder stack on a GPU: the measuring half of ``validate/gpu_profile.py``.

One file, torch, numpy and the standard library only (nothing from kvsim), so it can be copied
alone onto a GPU box. It builds the decoder-layer stack of a model geometry (Llama-3.1-8B by
default) with random weights made on the device, and times engine-like steps over a grid of
batch compositions: prefill chunks at several contexts, decode batches at several contexts,
mixed chunked-prefill batches. Each step is what one vLLM forward pass computes: embedding
gather, per layer RMSNorm, fused QKV, RoPE, KV-cache write, attention, output projection,
RMSNorm, fused gate/up, SiLU, down projection; then the final norm, the lm_head over one row
per request and a greedy argmax. Timed with CUDA events (medians after warm-ups), eagerly and
replayed as a CUDA graph. It also measures device copy bandwidth, the bf16 matmul rate and
pinned host<->device bandwidth::

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


# Split-KV modes of the SDPA path. "always": split whenever one attention call would run
# fewer thread blocks than twice the SMs (prefill chunks with context and decodes). "auto":
# decodes only, where that measured faster on the H200 (validate/profiles, run 2 against
# run 1): at most AUTO_SPLIT_MAX_TILES (request x KV head) tiles, i.e. <= 4 requests of
# Llama-3.1-8B, at contexts of AUTO_SPLIT_MIN_CONTEXT or more (1 request at 32k: 19.3 ->
# 8.7 ms). Elsewhere the split's extra merge kernels cost more than they gained (+10-55%).
SPLIT_MODES = ("auto", "always", "off")
AUTO_SPLIT_MAX_TILES = 32
AUTO_SPLIT_MIN_CONTEXT = 8192


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


class DecoderStack:
    """Random-weight Llama-style decoder stack with a paged KV pool, built on one device."""

    def __init__(
        self, torch: Any, geometry: dict[str, Any], device: Any, kv_tokens: int, page: int
    ) -> None:
        self.torch, self.g, self.device, self.page = torch, geometry, device, page
        g = geometry
        dt = torch.bfloat16
        self.dtype = dt
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        hidden, heads, kv_heads, hd = (
            g["hidden_size"],
            g["num_attention_heads"],
            g["num_key_value_heads"],
            g["head_dim"],
        )
        inter, vocab = g["intermediate_size"], g["vocab_size"]

        def rand(*shape: int, std: float = 0.02) -> Any:
            t = torch.empty(*shape, device=device, dtype=dt)
            return t.normal_(0.0, std, generator=gen)

        self.embed = rand(vocab, hidden, std=1.0)
        self.lm_head = rand(vocab, hidden)
        self.final_norm = torch.ones(hidden, device=device, dtype=dt)
        self.layers = []
        for _ in range(g["num_hidden_layers"]):
            self.layers.append(
                {
                    "qkv": rand((heads + 2 * kv_heads) * hd, hidden),
                    "o": rand(hidden, heads * hd),
                    "gate_up": rand(2 * inter, hidden),
                    "down": rand(hidden, inter),
                    "norm1": torch.ones(hidden, device=device, dtype=dt),
                    "norm2": torch.ones(hidden, device=device, dtype=dt),
                }
            )
        self.num_params = (
            2 * vocab * hidden
            + hidden
            + g["num_hidden_layers"]
            * (
                (heads + 2 * kv_heads) * hd * hidden
                + hidden * heads * hd
                + 3 * inter * hidden
                + 2 * hidden
            )
        )
        # KV pool per layer: [pages, page, kv_heads, head_dim] for K and for V, random values.
        self.num_pages = max(1, kv_tokens // page)
        self.k_pool = [rand(self.num_pages, page, kv_heads, hd, std=1.0) for _ in self.layers]
        self.v_pool = [rand(self.num_pages, page, kv_heads, hd, std=1.0) for _ in self.layers]
        max_pos = 1 << 17
        inv_freq = 1.0 / (
            g["rope_theta"] ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        )
        freqs = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)
        self.cos = freqs.cos().to(dt)
        self.sin = freqs.sin().to(dt)
        # (request, KV head, split) tiles split-KV decode aims for: twice the SMs on a GPU;
        # on the CPU a small number, so tests run the split path. 0 turns splitting off.
        self.split_target = (
            2 * torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 8
        )
        self.split_mode = "auto"
        # How varlen_attn takes the block table in this torch: set by _self_test_paged.
        self.paged_call: dict[str, Any] = {"table_kwarg": "block_table", "pass_cu_k": False}

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def build_batch(self, point: dict[str, int], paged: bool) -> dict[str, Any]:
        """Static input tensors of one step: prefill requests first, then decodes.

        Each request owns whole pages. A prefill chunk attends its context and itself; a
        decode attends its ``ctx`` computed tokens (its own new key is written but not read:
        one key in hundreds or more). ``paged`` hands pages out in a random order through a
        block table (as vLLM's block pool does after a while); otherwise the pages a request
        attends are consecutive, so its KV is one strided view for SDPA, and the page a
        decode's new key starts (when ``ctx`` fills its last page) sits after all of them.
        """
        torch, dev = self.torch, self.device
        n_pre, n_dec = point["num_prefill_reqs"], point["num_decode_reqs"]
        reqs = [(point["chunk_tokens"], point["prefill_context_tokens"])] * n_pre + [
            (1, point["decode_context_tokens"])
        ] * n_dec
        if n_dec and point["decode_context_tokens"] < 1:
            raise ValueError("a decode needs a context of at least 1 token")
        pages_per_req = [self.pages_for(ctx + q) for q, ctx in reqs]
        main_pages = [
            self.pages_for(ctx + q) if i < n_pre else self.pages_for(ctx)
            for i, (q, ctx) in enumerate(reqs)
        ]
        total_pages = sum(pages_per_req)
        if total_pages > self.num_pages:
            raise MemoryError(f"needs {total_pages} KV pages, pool holds {self.num_pages}")
        gen = torch.Generator()
        gen.manual_seed(1)
        order = torch.randperm(total_pages, generator=gen) if paged else torch.arange(total_pages)
        max_pages = max(pages_per_req)
        block_table = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
        token_pos, slots, logits_idx, cu_q, seqused = [], [], [], [0], []
        first, tail = 0, sum(main_pages)
        for i, (q, ctx) in enumerate(reqs):
            n_main, n_tail = main_pages[i], pages_per_req[i] - main_pages[i]
            table = torch.cat((order[first : first + n_main], order[tail : tail + n_tail]))
            first += n_main
            tail += n_tail
            block_table[i, : n_main + n_tail] = table.to(torch.int32)
            pos = torch.arange(ctx, ctx + q)
            token_pos.append(pos)
            slots.append(table[pos // self.page] * self.page + pos % self.page)
            cu_q.append(cu_q[-1] + q)
            logits_idx.append(cu_q[-1] - 1)
            seqused.append(ctx + q if i < n_pre else ctx)
        num_tokens = cu_q[-1]
        ids = torch.randint(0, self.g["vocab_size"], (num_tokens,), generator=gen)
        batch = {
            "ids": ids.to(dev),
            "positions": torch.cat(token_pos).to(dev),
            "slots": torch.cat(slots).to(dev),
            "logits_idx": torch.tensor(logits_idx).to(dev),
            "cu_q": torch.tensor(cu_q, dtype=torch.int32).to(dev),
            "seqused_k": torch.tensor(seqused, dtype=torch.int32).to(dev),
            "cu_k": torch.tensor([0, *seqused], dtype=torch.int32)
            .cumsum(0, dtype=torch.int32)
            .to(dev),
            "block_table": block_table.to(dev),
            "max_q": max(q for q, _ in reqs),
            "max_k": max(seqused),
            "point": point,
        }
        return batch

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _attention_paged(self, layer: int, q: Any, batch: dict[str, Any]) -> Any:
        from torch.nn.attention.varlen import varlen_attn

        call = self.paged_call
        return varlen_attn(
            q,
            self.k_pool[layer],
            self.v_pool[layer],
            batch["cu_q"],
            batch["cu_k"] if call["pass_cu_k"] else None,
            batch["max_q"],
            batch["max_k"],
            window_size=(-1, 0),
            enable_gqa=True,
            seqused_k=batch["seqused_k"],
            **{call["table_kwarg"]: batch["block_table"]},
        )

    def _attention_sdpa(self, layer: int, q: Any, batch: dict[str, Any]) -> Any:
        """SDPA over each phase's contiguous KV: prefill chunks (lower-right causal, batched
        when equal) and the decode batch (query heads grouped per KV head, non-causal)."""
        torch = self.torch
        from torch.nn.attention.bias import causal_lower_right

        F = torch.nn.functional
        p = batch["point"]
        g = self.g
        heads, kv_heads, hd = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
        k_flat = self.k_pool[layer].view(-1, kv_heads, hd)
        v_flat = self.v_pool[layer].view(-1, kv_heads, hd)
        outs = []
        first_page = 0
        n_pre, chunk, pctx = p["num_prefill_reqs"], p["chunk_tokens"], p["prefill_context_tokens"]
        prefill_splits, decode_splits = self.splits_for(p)
        if n_pre:
            kv_len = pctx + chunk
            span = self.pages_for(kv_len) * self.page
            kq = k_flat[: n_pre * span].view(n_pre, span, kv_heads, hd)[:, :kv_len]
            vq = v_flat[: n_pre * span].view(n_pre, span, kv_heads, hd)[:, :kv_len]
            if prefill_splits > 1:
                o = self._prefill_split(q[:chunk], kq[0], vq[0], pctx, prefill_splits)
                outs.append(o)
            else:
                qp = q[: n_pre * chunk].view(n_pre, chunk, heads, hd).transpose(1, 2)
                mask = causal_lower_right(chunk, kv_len) if pctx else None
                o = F.scaled_dot_product_attention(
                    qp,
                    kq.transpose(1, 2),
                    vq.transpose(1, 2),
                    attn_mask=mask,
                    is_causal=mask is None,
                    enable_gqa=True,
                )
                outs.append(o.transpose(1, 2).reshape(n_pre * chunk, heads, hd))
            first_page = n_pre * span
        n_dec, dctx = p["num_decode_reqs"], p["decode_context_tokens"]
        if n_dec:
            span = self.pages_for(dctx) * self.page
            kd = k_flat[first_page : first_page + n_dec * span].view(n_dec, span, kv_heads, hd)
            vd = v_flat[first_page : first_page + n_dec * span].view(n_dec, span, kv_heads, hd)
            qd = q[n_pre * chunk :].view(n_dec, kv_heads, heads // kv_heads, hd)
            o = self._decode_attention(qd, kd[:, :dctx], vd[:, :dctx], decode_splits)
            outs.append(o.reshape(n_dec, heads, hd))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def splits_for(self, point: dict[str, int]) -> tuple[int, int]:
        """Context splits of the SDPA path's prefill chunk and of its decodes (1: none).

        Prefill splits only a single chunk with context; decodes split only when their
        context fills whole pages (then each request's keys are packed in memory)."""
        g = self.g
        kv_heads, group = (
            g["num_key_value_heads"],
            g["num_attention_heads"] // g["num_key_value_heads"],
        )
        n_pre, chunk, pctx = (
            point["num_prefill_reqs"],
            point["chunk_tokens"],
            point["prefill_context_tokens"],
        )
        n_dec, dctx = point["num_decode_reqs"], point["decode_context_tokens"]
        if self.split_mode == "off":
            return 1, 1
        # FlashAttention-2 runs a thread block per 128 query rows and head.
        prefill_tiles = kv_heads * -(-group * chunk // 128)
        prefill = self.num_splits(prefill_tiles, pctx) if n_pre == 1 and pctx else 1
        packed = dctx > 0 and dctx % self.page == 0
        decode_tiles = n_dec * kv_heads
        decode = self.num_splits(decode_tiles, dctx) if n_dec and packed else 1
        if self.split_mode == "auto":
            prefill = 1
            if decode_tiles > AUTO_SPLIT_MAX_TILES or dctx < AUTO_SPLIT_MIN_CONTEXT:
                decode = 1
        return prefill, decode

    def num_splits(self, tiles: int, ctx: int) -> int:
        """Pieces to split a context of ``ctx`` keys into (flash-decoding) when one attention
        call would run only ``tiles`` thread blocks: enough to fill the device twice over,
        each piece at least a page long, ``ctx`` divisible by their number."""
        splits = 1
        while (
            tiles * splits < self.split_target
            and ctx % (2 * splits) == 0
            and ctx // (2 * splits) >= self.page
        ):
            splits *= 2
        return splits

    def _merge(self, outs: Any, lses: Any) -> Any:
        """Attention over the union of key sets from per-set outputs [n, ...rows, head_dim]
        and log-sum-exps [n, ...rows], in float32."""
        weight = (lses - lses.amax(dim=0, keepdim=True)).exp()
        return (outs.float() * weight.unsqueeze(-1)).sum(dim=0) / weight.sum(dim=0).unsqueeze(-1)

    def _prefill_split(self, q: Any, k: Any, v: Any, ctx: int, splits: int) -> Any:
        """One prefill chunk ``q`` [chunk, heads, head_dim] after ``ctx`` tokens, ``k``/``v``
        [ctx + chunk, kv_heads, head_dim]: the context in ``splits`` pieces every query sees
        whole (query heads grouped per KV head as rows), the chunk causally over itself
        (KV heads repeated for its few keys), merged by log-sum-exp. Returns [chunk, heads,
        head_dim]."""
        chunk, heads, hd = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        piece = ctx // splits
        # [chunk, kv_heads, group, hd] -> [kv_heads, group * chunk, hd]: one row per query.
        rows = q.view(chunk, kv_heads, group, hd).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, hd)
        kc = k[:ctx].reshape(splits, piece, kv_heads, hd).transpose(1, 2)
        vc = v[:ctx].reshape(splits, piece, kv_heads, hd).transpose(1, 2)
        rows = rows.expand(splits, -1, -1, -1).contiguous()
        o_ctx, lse_ctx = self._flash_with_lse(rows, kc, vc)
        o_ctx = o_ctx.reshape(splits, heads, chunk, hd)  # row (kv, g, t) is head kv*group+g
        lse_ctx = lse_ctx[..., : group * chunk].reshape(splits, heads, chunk)
        # Each KV head repeated for its query heads (head kv * group + g), as expand + copy:
        # no host sync, so it stays capturable in a CUDA graph.
        ks = k[ctx:].unsqueeze(2).expand(chunk, kv_heads, group, hd).reshape(chunk, heads, hd)
        vs = v[ctx:].unsqueeze(2).expand(chunk, kv_heads, group, hd).reshape(chunk, heads, hd)
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        o_self, lse_self = self._flash_with_lse(q.transpose(0, 1).unsqueeze(0), ks, vs, True)
        merged = self._merge(
            self.torch.cat((o_ctx, o_self)), self.torch.cat((lse_ctx, lse_self[..., :chunk]))
        )
        return merged.transpose(0, 1).to(q.dtype)

    def _flash_with_lse(self, q: Any, k: Any, v: Any, causal: bool = False) -> tuple[Any, Any]:
        """FlashAttention's output and log-sum-exp; [batch, heads, rows, head_dim] inputs."""
        aten = self.torch.ops.aten
        if self.device.type == "cuda":
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
        else:
            out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out[0], out[1]

    def _decode_attention(self, qd: Any, kd: Any, vd: Any, splits: int) -> Any:
        """Decode attention, ``qd`` [reqs, kv_heads, group, head_dim] (the query heads of one
        KV head as rows), ``kd``/``vd`` [reqs, ctx, kv_heads, head_dim]. With few requests
        the context is split into chunks attended in parallel and merged by their
        log-sum-exp (flash-decoding, what vLLM's decode kernels do); FlashAttention-2 alone
        would run one tile per (request, KV head) and leave most of the SMs idle. ``splits``
        > 1 needs ``kd`` packed: [reqs, ctx] over consecutive memory."""
        torch = self.torch
        reqs, ctx, kv_heads, hd = kd.shape
        group = qd.shape[2]
        if splits == 1:
            return torch.nn.functional.scaled_dot_product_attention(
                qd, kd.transpose(1, 2), vd.transpose(1, 2)
            )
        chunk = ctx // splits
        # kd is packed ([reqs, ctx] over consecutive memory), so this reshape is a view.
        ks = kd.reshape(reqs * splits, chunk, kv_heads, hd).transpose(1, 2)
        vs = vd.reshape(reqs * splits, chunk, kv_heads, hd).transpose(1, 2)
        qs = qd.unsqueeze(1).expand(reqs, splits, kv_heads, group, hd)
        out, lse = self._flash_with_lse(qs.reshape(reqs * splits, kv_heads, group, hd), ks, vs)
        out = out.reshape(reqs, splits, kv_heads, group, hd).transpose(0, 1)
        lse = lse[..., :group].reshape(reqs, splits, kv_heads, group).transpose(0, 1)
        return self._merge(out, lse).to(qd.dtype)

    def step(self, batch: dict[str, Any], paged: bool) -> Any:
        """One forward pass of the batch; returns the greedy next token of every request."""
        torch = self.torch
        F = torch.nn.functional
        g = self.g
        heads, kv_heads, hd = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
        hidden, inter = g["hidden_size"], g["intermediate_size"]
        eps = 1e-5
        positions = batch["positions"]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        slots = batch["slots"]
        h = self.embed[batch["ids"]]
        attention = self._attention_paged if paged else self._attention_sdpa
        for i, w in enumerate(self.layers):
            x = F.rms_norm(h, (hidden,), w["norm1"], eps)
            qkv = F.linear(x, w["qkv"])
            q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
            q = self._rope(q.view(-1, heads, hd), cos, sin)
            k = self._rope(k.view(-1, kv_heads, hd), cos, sin)
            self.k_pool[i].view(-1, kv_heads, hd).index_copy_(0, slots, k)
            self.v_pool[i].view(-1, kv_heads, hd).index_copy_(0, slots, v.view(-1, kv_heads, hd))
            o = attention(i, q, batch)
            h = h + F.linear(o.reshape(-1, heads * hd), w["o"])
            x = F.rms_norm(h, (hidden,), w["norm2"], eps)
            gate, up = F.linear(x, w["gate_up"]).split([inter, inter], dim=-1)
            h = h + F.linear(F.silu(gate) * up, w["down"])
        x = F.rms_norm(h[batch["logits_idx"]], (hidden,), self.final_norm, eps)
        return F.linear(x, self.lm_head).argmax(dim=-1)


def _self_test_split(stack: DecoderStack) -> str | None:
    """None when split-KV attention (decode and prefill, mode "always") agrees with unsplit
    SDPA; else why not (then splitting is turned off)."""
    torch = stack.torch
    g = stack.g
    ctx = 16 * stack.page
    target, mode = stack.split_target, stack.split_mode
    problems = []
    for point in (
        {"num_prefill_reqs": 0, "num_decode_reqs": 2, "decode_context_tokens": ctx},
        {"num_prefill_reqs": 1, "chunk_tokens": 8, "prefill_context_tokens": ctx},
    ):
        point = {
            "chunk_tokens": 0,
            "prefill_context_tokens": 0,
            "num_decode_reqs": 0,
            "decode_context_tokens": 0,
            **point,
        }
        try:
            batch = stack.build_batch(point, paged=False)
            q = torch.randn(
                batch["ids"].shape[0],
                g["num_attention_heads"],
                g["head_dim"],
                device=stack.device,
                dtype=stack.dtype,
            )
            stack.split_target, stack.split_mode = target, "always"
            got = stack._attention_sdpa(0, q, batch).float()
            stack.split_mode = "off"
            ref = stack._attention_sdpa(0, q, batch).float()
            err = float((ref - got).abs().max())
        except Exception as exc:
            problems.append(f"{point}: {type(exc).__name__}: {exc}"[:400])
            continue
        finally:
            stack.split_target, stack.split_mode = target, mode
        if not err < 0.05:
            problems.append(f"{point}: differs from unsplit SDPA by up to {err:.3g}")
    return "; ".join(problems) or None


def _self_test_paged(stack: DecoderStack) -> str | None:
    """None when the paged varlen kernel agrees with SDPA on a small mixed batch, else why not."""
    torch = stack.torch
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return f"torch.nn.attention.varlen not importable: {exc}"
    import inspect

    params = inspect.signature(varlen_attn).parameters
    table_kwargs = [k for k in ("block_table", "page_table") if k in params]
    if not table_kwargs or "seqused_k" not in params or "window_size" not in params:
        return f"varlen_attn({', '.join(params)}) takes no block table in this torch"
    point = {
        "num_prefill_reqs": 1,
        "chunk_tokens": 100,
        "prefill_context_tokens": 300,
        "num_decode_reqs": 3,
        "decode_context_tokens": 700,
    }
    g = stack.g
    try:
        batch_sdpa = stack.build_batch(point, paged=False)
        batch_paged = dict(batch_sdpa, point=point)  # same (consecutive) pages for both
        q = torch.randn(
            batch_sdpa["ids"].shape[0],
            g["num_attention_heads"],
            g["head_dim"],
            device=stack.device,
            dtype=stack.dtype,
        )
        ref = stack._attention_sdpa(0, q, batch_sdpa).float()
    except Exception as exc:
        return f"SDPA reference failed: {type(exc).__name__}: {exc}"[:400]
    problems = []
    for table_kwarg in table_kwargs:
        for pass_cu_k in (False, True):
            stack.paged_call = {"table_kwarg": table_kwarg, "pass_cu_k": pass_cu_k}
            try:
                got = stack._attention_paged(0, q, batch_paged).float()
                torch.cuda.synchronize()
                err = float((ref - got).abs().max())
                mean_err = float((ref - got).abs().mean())
            except Exception as exc:
                problems.append(f"{stack.paged_call}: {type(exc).__name__}: {exc}"[:300])
                continue
            if err < 0.1 and mean_err < 0.01:
                stack.paged_call["max_abs_diff_vs_sdpa"] = err
                return None
            problems.append(f"{stack.paged_call}: differs from SDPA by up to {err:.3g}")
    return "paged varlen kernel unusable: " + "; ".join(problems)


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
    paged_problem = _self_test_paged(stack) if gpu else "no paged kernel on the CPU"
    paged = paged_problem is None
    stack.split_mode = split_kv
    split_problem = _self_test_split(stack) if split_kv != "off" else None
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
