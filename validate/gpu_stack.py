"""The decoder stack ``validate/gpu_measure.py`` times: Llama-style layers with random weights
and a paged KV pool, built on one device, and the attention paths it can take.

torch and the standard library only (nothing from kvsim): it goes onto a GPU box beside
``gpu_measure.py``. One forward pass (:meth:`DecoderStack.step`) is what a vLLM step computes:
embedding gather, per layer RMSNorm, fused QKV, RoPE, KV-cache write, attention, output
projection, RMSNorm, fused gate/up, SiLU, down projection; then the final norm, the lm_head
over one row per request and a greedy argmax. Attention runs either paged
(``torch.nn.attention.varlen``, FlashAttention-2 through a block table, like vLLM's
FLASH_ATTN backend) or as SDPA per phase over consecutive pages, split over the context
(flash-decoding) where few requests would leave SMs idle; :func:`self_test_paged` and
:func:`self_test_split` check each against plain SDPA before ``measure`` uses it.
"""

from __future__ import annotations

from typing import Any

# Split-KV modes of the SDPA path. "always": split whenever one attention call would run
# fewer thread blocks than twice the SMs (prefill chunks with context and decodes). "auto":
# decodes only, where that measured faster on the H200 (validate/profiles, run 2 against
# run 1): at most AUTO_SPLIT_MAX_TILES (request x KV head) tiles, i.e. <= 4 requests of
# Llama-3.1-8B, at contexts of AUTO_SPLIT_MIN_CONTEXT or more (1 request at 32k: 19.3 ->
# 8.7 ms). Elsewhere the split's extra merge kernels cost more than they gained (+10-55%).
SPLIT_MODES = ("auto", "always", "off")
AUTO_SPLIT_MAX_TILES = 32
AUTO_SPLIT_MIN_CONTEXT = 8192


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
        # How varlen_attn takes the block table in this torch: set by self_test_paged.
        self.paged_call: dict[str, Any] = {"table_kwarg": "block_table", "pass_cu_k": False}

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def random_query(self, batch: dict[str, Any]) -> Any:
        """Random attention queries for every token of ``batch``: [tokens, heads, head_dim]
        (what the self-tests feed both attention paths)."""
        return self.torch.randn(
            batch["ids"].shape[0],
            self.g["num_attention_heads"],
            self.g["head_dim"],
            device=self.device,
            dtype=self.dtype,
        )

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


def self_test_split(stack: DecoderStack) -> str | None:
    """None when split-KV attention (decode and prefill, mode "always") agrees with unsplit
    SDPA; else why not (then splitting is turned off)."""
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
            q = stack.random_query(batch)
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


def self_test_paged(stack: DecoderStack) -> str | None:
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
    try:
        batch_sdpa = stack.build_batch(point, paged=False)
        batch_paged = dict(batch_sdpa, point=point)  # same (consecutive) pages for both
        q = stack.random_query(batch_sdpa)
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
