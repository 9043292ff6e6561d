"""Hugging Face transformers adapter, attention: evenflow's paged decode and prefill attention under a model's own
``generate`` (or forward), through a paged KV cache that keeps each request's real tokens only.

    import evenflow.integrations.transformers as ev_tf
    ev_tf.enable_attention(model)                  # attn_implementation "evenflow"
    cache = ev_tf.PagedCache(model, max_batch_size=64, max_cache_len=32768)
    out = model.generate(**tok(prompts, padding=True, padding_side="left", return_tensors="pt").to("cuda"),
                         cache=cache, max_new_tokens=256)   # (past_key_values= before transformers 5.2x)

Why: transformers' own caches hold a batch as one padded rectangle (every request as long as the longest, left
padding included) and attend over all of it. Here each request's K and V go into pages of its own and the padding
never enters the cache, so a decode step reads each request's real length only, through
:func:`evenflow.decode_attention` balanced by a :class:`evenflow.DecodePlan` (updated once a step, shared by every
layer); a forward of more than one token per request (the prompt, or an extend) runs
:func:`evenflow.prefill_attention`. It holds no math: it maps the model's tensors onto those operators and
:func:`evenflow.attention.prologue.store_kv`.

How it plugs in (transformers 5): ``PagedCache`` is a ``Cache`` whose layers take the new K / V in ``update`` and
hand a handle to the attention function through the forward's keyword arguments (the mechanism transformers' own
continuous batching uses); the attention function ``"evenflow"`` (``AttentionInterface``) writes them into the pages
and runs the kernels; its mask function (``AttentionMaskInterface``) passes the 2-D padding mask through. Attention
modules of Qwen3-MoE's form (``enable_attention(fuse_prologue=True)``, the default) instead get a forward of their own
on the instance: one GEMM over the concatenated q / k / v projections, then :func:`evenflow.qk_norm_rope_store_kv`
(QK-RMSNorm, the rotation from a table of the model's own rotary embedding, the store) and the attention, where the
stock forward runs the norms, the rotation and the store as some twenty small kernels. The fused form rotates each
token at its index among its request's real tokens (what generate's positions are for a left-padded batch), so it
does not read ``position_ids``: rotary attention depends on position differences only, which a per-request offset
leaves as they are.

What it takes: decoder-only models whose attention modules call ``cache.update(..., kwargs=kwargs)`` (Llama, Qwen2/3,
Qwen3-MoE, Mixtral, ... in transformers 5.25), full causal attention (no sliding window shorter than the cache, no
attention sinks or logit softcapping), head_dim 64 / 128 / 256, a GQA group of at most 16, bf16. Padding on the left
(the prompt's padding precedes its tokens; ``tokenizer.padding_side = "left"``, as generate wants for decoder-only
models), a plain causal mask pattern (no bidirectional prefix or other overlay), ``use_cache=True``, the model on one
device; anything else raises naming what it found. Greedy or sampled decoding (``num_return_sequences`` included:
generate repeats the prompts before the cache sees them), beam search (``reorder_cache`` copies each continued beam's
tokens into pages of its own, one host sync a step) and assisted decoding (``crop`` drops the rejected draft tokens);
``batch_select_indices`` / ``batch_repeat_interleave`` change the rows when called directly (contrastive search,
which calls them, moved to the Hub in transformers 5 and is not run by this adapter's tests). A new prompt batch
needs a fresh cache or :meth:`PagedCache.reset` (a mask that does not cover the positions the cache has seen raises).
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import types

import torch

import evenflow
from evenflow import _runtime
from evenflow._checks import check_bool, check_choice, check_int
from evenflow.attention.plan import HEAD_DIMS, KV_DTYPES, MAX_GQA_GROUP
from evenflow.attention.prologue import store_kv
from evenflow.integrations._common import held, normalised_source, refuse_autograd

IMPLEMENTATION = "evenflow"
_HANDLE = "evenflow_paged"  # the forward kwarg the cache's update hands to the attention function


# The oldest transformers the adapter runs on: 5.24 is the first release whose attention modules hand their
# forward's kwargs to ``cache.update`` (the PagedCache reads each step's positions there) and take the cache as
# ``cache=``; 5.17-5.23 call ``past_key_values.update(k, v, layer_idx)`` (read in their wheels' Qwen3-MoE modeling
# code), and 5.17's FP8 experts differ too (round BW's device machine ran 5.17: the adapter's tests raised there).
MIN_TRANSFORMERS = (5, 24)
NEEDS = f"evenflow.integrations.transformers needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}"


def require_transformers() -> None:
    """Raise ``ImportError`` (naming both versions) unless a transformers the adapter runs on is installed."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{NEEDS}: {e}") from e
    from packaging.version import Version  # (a dependency of transformers)

    if Version(transformers.__version__).release[:2] < MIN_TRANSFORMERS:
        raise ImportError(f"{NEEDS}, found {transformers.__version__} (pip install 'evenflow[transformers]')")


def _cache_base():
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin
    except ImportError as e:
        raise ImportError(f"{NEEDS}: {e}") from e
    return Cache, CacheLayerMixin


def _config_of(model_or_config):
    cfg = getattr(model_or_config, "config", model_or_config)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for name in ("num_hidden_layers", "num_attention_heads"):
        if not isinstance(getattr(cfg, name, None), int):
            raise TypeError(f"model: its config has no integer {name}; PagedCache needs a decoder-only text model")
    return cfg


def _attention_dims(cfg) -> tuple[int, int, int, int]:
    """(layers, q heads, kv heads, head_dim) of a decoder-only config, refusing what the kernels do not compute."""
    layers, hq = cfg.num_hidden_layers, cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    if getattr(cfg, "kv_lora_rank", None) is not None:
        raise TypeError("model: multi-head latent attention (kv_lora_rank) is not evenflow's paged attention")
    if d not in HEAD_DIMS:
        raise TypeError(f"model: head_dim {d}: evenflow's paged attention takes {list(HEAD_DIMS)}")
    if hq % hkv or hq // hkv > MAX_GQA_GROUP:
        raise TypeError(f"model: {hq} q heads over {hkv} kv heads: evenflow's paged attention takes a GQA group of "
                        f"1-{MAX_GQA_GROUP}")
    types_ = getattr(cfg, "layer_types", None)
    if types_ is not None and any(t != "full_attention" for t in types_):
        raise TypeError(f"model: layer types {sorted(set(types_))}: evenflow's paged attention computes full causal "
                        "attention only")
    return layers, hq, hkv, d


def _rotary(model) -> torch.nn.Module | None:
    """The model's rotary embedding where a fixed table describes it: one position id per token (no multimodal
    sections), a type whose frequencies do not move with the length (not dynamic or longrope); else None."""
    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    rope_type = str(getattr(rot, "rope_type", "default"))
    if (not isinstance(rot, torch.nn.Module) or not isinstance(getattr(rot, "inv_freq", None), torch.Tensor)
            or "dynamic" in rope_type or "longrope" in rope_type or getattr(rot, "mrope_section", None) is not None
            or "mrope_section" in (getattr(getattr(rot, "config", None), "rope_parameters", None) or {})):
        return None
    return rot


def _rope_table(model, rows: int, device, head_dim: int) -> torch.Tensor | None:
    """The fused prologue's rotary table ``[rows, R]`` fp32 (cos then sin of each frequency) from the model's own
    rotary embedding (its ``rope_theta``, scaling and attention factor), or None where :func:`_rotary` finds none or
    its table is not the rotate-half layout."""
    rot = _rotary(model)
    if rot is None:
        return None
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, dtype=torch.float32, device=device), torch.arange(rows, device=device)[None])
    cos, sin = cos[0].float(), sin[0].float()
    r = cos.shape[-1]
    if r > head_dim or r % 2 or not (torch.equal(cos[:, : r // 2], cos[:, r // 2:])
                                      and torch.equal(sin[:, : r // 2], sin[:, r // 2:])):
        return None
    return torch.cat([cos[:, : r // 2], sin[:, : r // 2]], 1).contiguous()


@functools.cache
def _fusable_class(cls: type) -> bool:
    """Whether attention class ``cls`` computes exactly Qwen3-MoE's attention forward (projections, QK-RMSNorm before
    the rotation, the cache update, the attention function, the output projection), judged by its code."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

    form = normalised_source(Qwen3MoeAttention.forward)
    return form is not None and normalised_source(cls.forward) == form


@functools.cache
def _rms_norm_class(cls: type) -> bool:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    form = normalised_source(Qwen3MoeRMSNorm.forward)
    return form is not None and normalised_source(cls.forward) == form


_FUSED_PARTS = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")


def _fusable(m: torch.nn.Module) -> bool:
    """Whether the fused forward computes what ``m``'s own would: Qwen3-MoE's attention code, plain ``nn.Linear``
    q / k / v projections and Qwen3's RMSNorm on q and k with one eps, none of them hooked (the fused forward calls
    none of their forwards, so a wrapper, an adapter or a hook there would be skipped). Checked at every call: a
    module changed after :func:`enable_attention` runs its own forward."""
    parts = [getattr(m, n, None) for n in _FUSED_PARTS]
    return (_fusable_class(type(m)) and all(type(p) is torch.nn.Linear for p in parts[:3])
            and all(isinstance(n, torch.nn.Module) and _rms_norm_class(type(n)) for n in parts[3:])
            and parts[3].variance_epsilon == parts[4].variance_epsilon
            and not any(p._forward_hooks or p._forward_pre_hooks for p in parts))


def _qkv_weight(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The module's q / k / v projections as one (weight, bias), held while they stay as they are
    (:func:`evenflow.integrations._common.held`; the projections' weights a second time in memory)."""
    parts = [getattr(m, n) for n in ("q_proj", "k_proj", "v_proj")]

    def build():
        w = torch.cat([p.weight for p in parts])
        if all(p.bias is None for p in parts):
            return w, None
        return w, torch.cat([p.bias if p.bias is not None else w.new_zeros(p.weight.shape[0]) for p in parts])

    return held(m, "_evenflow_qkv", [t for p in parts for t in (p.weight, p.bias)], build)


def _fused_attention_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """Qwen3-form attention on evenflow's fused prologue (installed on the instance by :func:`enable_attention`):
    one projection GEMM, ``qk_norm_rope_store_kv``, the paged attention, the output projection. The rotation is at
    each token's index among its request's real tokens (the positions generate gives a left-padded batch; the
    attention is the same for any positions that differ from them by a constant per request). Without a PagedCache
    that has a rotary table, or where the module no longer passes :func:`_fusable`, the class's own forward runs."""
    if not getattr(cache, "_evenflow_paged", False) or cache.rope_table is None or not _fusable(self):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    name = type(self).__name__
    if kwargs.get("use_cache") is False:
        raise ValueError(f"{name}: use_cache=False with a PagedCache: every call would store its tokens again; "
                         "generate with use_cache=True")
    if self.training and getattr(self, "attention_dropout", 0.0):
        raise ValueError(f"{name}: dropout {self.attention_dropout} in training mode: evenflow's paged attention is "
                         "for inference")
    window = getattr(self, "sliding_window", None)
    if window is not None and window < cache.max_cache_len:
        raise TypeError(f"{name}: sliding window {window} under the cache's {cache.max_cache_len} positions; "
                        "evenflow's paged attention computes full causal attention")
    # (lazily: under no_grad, as generate runs, the parameters are never walked; round CM: 19-21 -> 0.9 us a layer)
    refuse_autograd(self, itertools.chain((hidden_states,),
                                          (p for n in _FUSED_PARTS for p in getattr(self, n).parameters())))
    w, b = _qkv_weight(self)
    out = cache.attend_fused(self, torch.nn.functional.linear(hidden_states, w, b), attention_mask)
    return self.o_proj(out), None


def is_fused_attention(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is evenflow's fused-prologue attention."""
    fwd = module.__dict__.get("forward")
    return getattr(fwd, "__func__", None) is _fused_attention_forward


class _Step:
    """What every layer of one forward shares: the lengths after this step, the slots of its new tokens, the
    decode plan (updated once a step) and the prefill boundaries."""

    def __init__(self, max_batch: int, pages_per_request: int, page_size: int, num_pages: int, device, plan):
        self.page_size, self.num_pages = page_size, num_pages
        # pages are handed out from a pool as each request's length needs them (host-side bounds, no sync at a
        # decode step); a column no page was handed to points at the spare page, which padding rows write to
        self.spare = num_pages
        # one column more than a request can use, always the spare page: the fused prologue stores a padding row at
        # that column's first position (``spare_pos``), since it finds a slot from a position
        self.page_table = torch.full((max_batch, pages_per_request + 1), num_pages, dtype=torch.int32, device=device)
        self.pages_per_request = pages_per_request
        self.spare_pos = pages_per_request * page_size
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # set where a step masked a new position of a request that already held tokens (padding after its real
        # tokens): its last positions are then not all real tokens, which crop() counts on (see there)
        self.gap = torch.zeros((), dtype=torch.int32, device=device)
        self.plan = plan
        self.batch = 0
        self.q_len = 0
        self.lens = self.store_pos = self._slots = None
        self.cu_q = self._steps = None  # (by batch and new tokens a request: the same tensors every decode step)
        self._release()

    def _release(self) -> None:
        self.free = list(range(self.num_pages))
        self.free.reverse()  # popped from the end: pages handed out in increasing order
        self.pages = [[] for _ in range(self.page_table.shape[0])]  # each request's pages, in order (host mirror)
        self.bound = [0] * self.page_table.shape[0]  # a host-side bound on each request's cached tokens

    def _grow(self, increments: list[int]) -> None:
        """Hand each request the pages its bound after this step needs (one small host-to-device copy where any
        request crosses into a new page)."""
        P, rows, cols, vals = self.page_size, [], [], []
        need_total = sum(max(0, -(-(self.bound[b] + n) // P) - len(self.pages[b])) for b, n in enumerate(increments))
        self._check_pool(need_total, "this step")
        for b, n in enumerate(increments):
            self.bound[b] += n
            own = self.pages[b]
            while len(own) * P < self.bound[b]:
                rows.append(b)
                cols.append(len(own))
                own.append(self.free.pop())
                vals.append(own[-1])
        if rows:
            dev = self.page_table.device
            self.page_table.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                                       torch.tensor(vals, dtype=torch.int32, device=dev))

    def begin(self, mask: torch.Tensor | None, batch: int, q_len: int, seen: int) -> None:
        dev = self.seq_lens.device
        if mask is not None:
            if mask.dim() != 2 or tuple(mask.shape) != (batch, seen + q_len):
                raise ValueError(f"attention_mask: expected the 2-D padding mask of every position so far, [{batch}, "
                                 f"{seen + q_len}] (the {seen} this cache has seen and {q_len} new), got "
                                 f"{tuple(mask.shape)}: a cache that was not reset() for a new batch, generate with "
                                 "use_cache=False, or a 4-D / custom mask")
            mask = mask.to(device=dev, dtype=torch.bool)
        lens = self.seq_lens[:batch]
        if self.batch and batch != self.batch:
            raise ValueError(f"batch of {batch} rows after {self.batch}: the cache's rows are requests; change them "
                             "with reorder_cache / batch_select_indices / batch_repeat_interleave, or reset() it for "
                             "a new batch")
        increments = [q_len] * batch  # a bound: at a decode step each request grows by at most its new token
        if mask is None:
            n_new = torch.full((batch,), q_len, dtype=torch.int32, device=dev)
        else:
            new = mask[:, -q_len:]
            n_new = new.sum(1, dtype=torch.int32)
            if q_len > 1 and _runtime.host_sync_allowed(lens):  # one sync a prompt or extend, none a decode step
                late_pad = (new[:, 1:] < new[:, :-1]).any(1).to(torch.int32)
                past = mask[:, :-q_len].sum(1, dtype=torch.int32)
                n_host, late_host, match_host = torch.stack([n_new, late_pad, (past == lens).to(torch.int32)]).tolist()
                if any(late_host):
                    raise ValueError("attention_mask: a padding position follows a real token among the new ones; "
                                     "evenflow's paged cache keeps real tokens only and needs the padding on the "
                                     "left (tokenizer.padding_side = 'left')")
                if not all(match_host):
                    raise ValueError("attention_mask: its past positions do not count the tokens this cache holds "
                                     "(a mask of another batch, or a cache that was not reset)")
                increments = n_host  # a prompt's real tokens
        self._grow(increments)
        if self._steps is None or self._steps[0] != (batch, q_len):
            self._steps = ((batch, q_len), torch.arange(q_len, device=dev, dtype=torch.int32))
            self.cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev)
        t = self._steps[1]
        first = q_len - n_new  # new rows before it are padding; the real ones end the row block
        if mask is not None:  # a request holding tokens (lens > 0) with padding among its new rows (first > 0):
            # three small kernels, no sync (a decode step stays graph-capturable)
            torch.maximum(self.gap, torch.minimum(lens, first).amax(), out=self.gap)
        real = t[None, :] >= first[:, None]
        # each real token at its index among its request's real tokens, a padding row at the spare column's first
        # position (its page the spare page), where a store of it lands harmlessly
        self.store_pos = torch.where(real, lens[:, None] + t[None, :] - first[:, None], self.spare_pos).reshape(-1)
        self._slots = None
        lens.add_(n_new)
        self.lens, self.batch, self.q_len = lens, batch, q_len
        if q_len == 1 and self.plan is not None:
            self.plan.update(lens)

    def _check_pool(self, need: int, what: str, free: int | None = None) -> None:
        free = len(self.free) if free is None else free
        if need > free:
            raise ValueError(f"PagedCache is out of pages: {what} needs {need} more of {self.page_size} tokens, "
                             f"{free} of {self.num_pages} are free (raise max_tokens, or reset() it)")

    def take_rows(self, idx: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
        """Make row ``i`` of the batch a copy of row ``idx[i]`` (beam search's reorder, a selection or a repetition
        of rows; the batch becomes ``len(idx)`` rows): its length, its bound and its tokens. A row that stays where
        it is keeps its pages; every other row gets pages of its own (free pages first, then the pages of rows no
        longer kept as they are), and each layer's ``kv`` copies its source's pages there, all of them read before
        any is written (a source page may be a destination; copied as bytes, which every cache dtype allows). Rows
        never share a page, since each stores its next tokens into its own. Checks everything before it changes
        anything; a copy that fails part way (e.g. out of memory for a layer's gathered pages) after writing over
        pages of replaced rows leaves no row's tokens to trust, so the cache is then emptied (as ``reset``) and the
        error raised."""
        batch = self.batch
        if not idx:
            raise ValueError(f"{what}: no rows; the cache needs at least one request (reset() it for a new batch)")
        if len(idx) > self.page_table.shape[0]:
            raise ValueError(f"{what}: {len(idx)} rows over the PagedCache's max_batch_size {self.page_table.shape[0]}")
        bad = [i for i in idx if not 0 <= i < batch]
        if bad:
            raise ValueError(f"{what}: row {bad[0]} is not one of the batch's {batch} rows")
        if idx == list(range(batch)):
            return  # every row stays where it is: nothing to copy or rewrite
        old = self.pages
        kept = [j == i for i, j in enumerate(idx)]  # (j < batch, so i < batch where it holds)
        # popped from the end: free pages first (the lowest first), then the replaced rows' (the lowest first)
        replaced = sorted((p for b in range(batch) if not (b < len(idx) and kept[b]) for p in old[b]), reverse=True)
        pool = replaced + sorted(self.free, reverse=True)
        self._check_pool(sum(len(old[j]) for j, k in zip(idx, kept) if not k), what, len(pool))
        src, dst, pages = [], [], []
        for j, k in zip(idx, kept):
            if k:
                pages.append(old[j])
                continue
            pages.append([pool.pop() for _ in old[j]])
            src += old[j]
            dst += pages[-1]
        dev = self.page_table.device
        if src:
            si, di = (torch.tensor(x, device=dev) for x in (src, dst))
            try:
                for keys, values in kv:
                    for cache in (keys, values):
                        raw = cache.view(torch.uint8)  # (index_copy_ has no float8 kernel)
                        raw.index_copy_(0, di, raw.index_select(0, si))
            except BaseException:
                if set(dst) & set(replaced):
                    self.reset()
                raise
        rows = len(idx)
        lens = self.seq_lens[:batch].index_select(0, torch.tensor(idx, device=dev))
        self.seq_lens.zero_()
        self.seq_lens[:rows] = lens
        table = torch.full(self.page_table.shape, self.spare, dtype=torch.int32)
        for i, own in enumerate(pages):
            table[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        self.page_table.copy_(table)
        empty = self.page_table.shape[0] - rows
        self.pages, self.free = pages + [[] for _ in range(empty)], pool
        self.bound = [self.bound[j] for j in idx] + [0] * empty
        self.batch = rows
        self.lens = self.store_pos = self._slots = None

    def crop(self, n: int) -> None:
        """Drop each request's last ``n`` positions: with the padding on the left, a request's real tokens are its
        last positions, so it loses ``min(n, its length)`` of them; its pages stay, overwritten as it grows again.
        (That holds where no padding follows a request's first real token: ``begin`` refuses it within a prompt or
        extend, and generate's decode steps mark every new token real. A step that masks a new position of a
        request that already holds tokens sets ``gap``, and a crop after it raises, where a host sync is allowed:
        it would take real tokens off that request.)"""
        if _runtime.host_sync_allowed(self.seq_lens) and bool(self.gap):
            raise ValueError("crop: a step since the last reset() masked a new position of a request that already "
                             "held tokens (padding after its real tokens); the paged cache keeps real tokens only, so "
                             "cropping positions would remove real ones")
        self.seq_lens[: self.batch].sub_(n).clamp_(min=0)
        self.bound = [max(0, b - n) for b in self.bound]
        self.lens = self.store_pos = self._slots = None

    def slots(self) -> torch.Tensor:
        """The step's tokens' flat cache slots (``page * P + offset``: the spare page's first for padding rows), for
        :func:`store_kv`; made at the first call of a step (the fused prologue finds them from ``store_pos``)."""
        if self._slots is None:
            P, pos = self.page_size, self.store_pos.view(self.batch, self.q_len)
            page = self.page_table[: self.batch].gather(1, (pos // P).long())
            self._slots = (page.long() * P + (pos % P).long()).reshape(-1)
        return self._slots

    def table(self, batch: int) -> torch.Tensor:
        """The attention kernels' page table: the batch's rows, the columns a request can use."""
        return self.page_table[:batch, : self.pages_per_request]

    def reset(self) -> None:
        self.seq_lens.zero_()
        self.gap.zero_()
        self.page_table.fill_(self.spare)
        self._release()
        self.batch, self.q_len = 0, 0
        self.lens = self.store_pos = self._slots = None


@functools.cache
def _layer_class():
    _, CacheLayerMixin = _cache_base()

    class PagedLayer(CacheLayerMixin):
        """One layer's pages: ``keys`` / ``values`` ``[pages + 1, P, Hkv, D]`` (the last page a spare that padding rows
        write to). ``update`` stores nothing itself: it hands the attention function this layer (the store and the
        attention run there, where the padding mask is known)."""

        is_compileable = False
        is_croppable = True  # (by PagedCache.crop, for every layer at once)
        supports_early_init = False

        def __init__(self, owner, index: int, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.owner, self.index = owner, index
            self.keys, self.values = keys, values
            self.is_initialized = True
            self.device = keys.device

        def lazy_initialization(self, key_states, value_states) -> None:
            return None

        def update(self, key_states, value_states, *args, kwargs=None, **extra):
            if kwargs is None:
                raise TypeError("PagedCache: the attention module called cache.update without its forward's kwargs; "
                                "evenflow's paged attention needs modules that pass kwargs=kwargs (transformers 5 "
                                "models do)")
            owner = self.owner
            if owner.unattended is not None:  # the last update's handle was never taken by evenflow's attention
                layer, owner.unattended = owner.unattended, None
                raise RuntimeError(
                    f"PagedCache: layer {layer}'s cache.update was not followed by evenflow's paged attention, which "
                    "stores and attends over the pages (update itself stores nothing and hands back only this "
                    "forward's K / V, so another attention would attend to the new tokens alone): set the model's "
                    "attention to 'evenflow' (evenflow.integrations.transformers.enable_attention)")
            owner.unattended = self.index
            kwargs[_HANDLE] = self
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.owner.seen + query_length, 0

        def get_seq_length(self) -> int:
            return self.owner.seen

        def get_max_length(self) -> int:
            return self.owner.max_cache_len

        def reset(self) -> None:
            self.owner.reset()

        def _whole_cache(self, name: str):
            raise NotImplementedError(f"PagedLayer.{name}: a PagedCache's layers share their rows' pages and "
                                      f"lengths; call PagedCache.{name}, which changes every layer at once")

        def reorder_cache(self, beam_idx) -> None:
            self._whole_cache("reorder_cache")

        def crop(self, tokens_to_remove: int) -> None:
            self._whole_cache("crop")

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._whole_cache("batch_repeat_interleave")

        def batch_select_indices(self, indices) -> None:
            self._whole_cache("batch_select_indices")

    return PagedLayer


@functools.cache
def _cache_class():
    Cache, _ = _cache_base()

    class PagedCache(Cache):
        __doc__ = _PAGED_CACHE_DOC
        _evenflow_paged = True

        def __init__(self, model, max_batch_size: int, max_cache_len: int, *, page_size: int = 64,
                     max_tokens: int | None = None, kv_dtype: torch.dtype | None = None, k_scale: float | None = None,
                     v_scale: float | None = None, plan: bool = True, device=None, **plan_options):
            cfg = _config_of(model)
            layers, hq, hkv, d = _attention_dims(cfg)
            check_bool("plan", plan)
            check_int("max_batch_size", max_batch_size, 1)
            check_int("max_cache_len", max_cache_len, 1)
            check_int("page_size", page_size)
            check_choice("page_size", page_size, (16, 32, 64, 128))
            kv_dtype = torch.bfloat16 if kv_dtype is None else kv_dtype
            if kv_dtype not in KV_DTYPES:
                raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype}")
            window = getattr(cfg, "sliding_window", None)
            types = getattr(cfg, "layer_types", None)  # where a config lists them, a window applies to its sliding
            slides = types is None or "sliding_attention" in types  # layers only (round CP: Mellum's are all full)
            if window is not None and getattr(cfg, "use_sliding_window", True) and slides and window < max_cache_len:
                raise TypeError(f"model: sliding window {window} under max_cache_len {max_cache_len}: evenflow's "
                                "paged attention computes full causal attention")
            if device is None:
                params = getattr(model, "parameters", None)
                device = next(params()).device if params is not None else "cuda"
            device = torch.device(device)
            # (max_batch_size / max_cache_len are this class's properties: some transformers 5 releases make them
            # read-only properties of Cache, computed from its layers; round BW's device machine had one)
            self._max_batch, self._max_len, self.page_size = max_batch_size, max_cache_len, page_size
            self.num_q_heads, self.num_kv_heads, self.head_dim, self.kv_dtype = hq, hkv, d, kv_dtype
            self.k_scale, self.v_scale = k_scale, v_scale
            self.seen = 0
            self.unattended: int | None = None  # a layer whose update's handle no attention has taken yet
            ppr = math.ceil(max_cache_len / page_size)
            if max_tokens is None:
                pages = max_batch_size * ppr
            else:
                check_int("max_tokens", max_tokens, 1)
                pages = math.ceil(max_tokens / page_size)
            self.max_tokens = pages * page_size
            with torch.inference_mode(False):  # tensors updated in place later, in or out of inference mode
                self._build(model, layers, hq, hkv, d, pages, ppr, device, plan, plan_options)

        def _build(self, model, layers, hq, hkv, d, pages, ppr, device, plan, plan_options) -> None:
            page_size, kv_dtype = self.page_size, self.kv_dtype
            decode_plan = None
            if plan:
                decode_plan = evenflow.DecodePlan(self.max_batch_size, ppr * page_size, hkv, page_size=page_size,
                                                  q_len=1, device=device, kv_dtype=kv_dtype, num_q_heads=hq,
                                                  head_dim=d, **plan_options)
            elif plan_options:
                raise ValueError(f"plan options {sorted(plan_options)} given with plan=False")
            self.step = _Step(self.max_batch_size, ppr, page_size, pages, device, decode_plan)
            # the fused prologue's rotary table, every position a request can use and the spare's
            self.rope_table = _rope_table(model, (ppr + 1) * page_size, device, d)
            layer_cls = _layer_class()
            shape = (pages + 1, page_size, hkv, d)  # (+ the spare page)
            super().__init__(layers=[layer_cls(self, i, torch.zeros(shape, dtype=kv_dtype, device=device),
                                               torch.zeros(shape, dtype=kv_dtype, device=device))
                                     for i in range(layers)])

        @property
        def max_batch_size(self) -> int:
            """The most requests a batch may hold."""
            return self._max_batch

        @property
        def max_cache_len(self) -> int:
            """Positions a request may reach (prompt padding included)."""
            return self._max_len

        @property
        def plan(self):
            return self.step.plan

        @property
        def seq_lens(self) -> torch.Tensor:
            """Each request's cached (real) tokens, [batch] int32."""
            return self.step.seq_lens[: self.step.batch]

        def reset(self) -> None:
            """Empty every request (the pages are overwritten as the next batch writes them)."""
            self.seen = 0
            self.unattended = None
            self.step.reset()

        def _rows(self, what: str, idx) -> None:
            """Row ``i`` becomes a copy of row ``idx[i]`` in every layer (:meth:`_Step.take_rows`); nothing to do
            while the cache holds no token (the next forward sets the batch), once the indices are checked to be
            ints. One host sync (the indices)."""
            if isinstance(idx, torch.Tensor):
                if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
                    raise ValueError(f"{what}: expected a 1-D tensor of row indices, got {idx.dim()}-D {idx.dtype}")
                idx = idx.tolist()
            if not isinstance(idx, (list, tuple)):
                raise TypeError(f"{what}: expected a 1-D tensor or a list of row indices, got {type(idx).__name__}")
            bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int)]
            if bad:  # a float or a bool would be truncated into some row
                raise TypeError(f"{what}: row indices must be ints, got {bad[0]!r}")
            if self.seen == 0:
                return
            try:
                self.step.take_rows(list(idx), [(lyr.keys, lyr.values) for lyr in self.layers], what)
            finally:
                if self.step.batch == 0:  # a copy that failed part way emptied the rows (take_rows)
                    self.seen = 0

        def reorder_cache(self, beam_idx) -> None:
            """Beam search: row ``i`` continues beam ``beam_idx[i]`` (its tokens copied into pages of its own)."""
            self._rows("beam_idx", beam_idx)

        def batch_select_indices(self, indices) -> None:
            """Keep the rows ``indices``, in that order (contrastive search)."""
            self._rows("indices", indices)

        def batch_repeat_interleave(self, repeats: int) -> None:
            """Each row ``repeats`` times in a row (contrastive search)."""
            check_int("repeats", repeats, 1)
            self._rows("repeats", [b for b in range(self.step.batch) for _ in range(repeats)])

        def crop(self, tokens_to_remove: int) -> None:
            """Remove the last ``-tokens_to_remove`` positions (assisted decoding's rejected draft tokens); as
            transformers' own caches, a positive count (the old absolute form) raises."""
            check_int("tokens_to_remove", tokens_to_remove)
            if tokens_to_remove > 0:
                raise ValueError(f"tokens_to_remove: {tokens_to_remove}; pass minus the number of positions to "
                                 "remove")
            n = -tokens_to_remove
            if n > self.seen:
                raise ValueError(f"tokens_to_remove: {tokens_to_remove}, but the cache has seen {self.seen} positions")
            if n:
                self.seen -= n
                self.step.crop(n)

        def _enter(self, layer, batch: int, q_len: int, attention_mask, device) -> None:
            """Begin the forward's step at its first layer (lengths, positions, pages, plan), or check that a later
            layer agrees with it."""
            if device != layer.keys.device:
                raise ValueError(f"inputs on {device}, the PagedCache on {layer.keys.device}: the cache lives on one "
                                 "device (a model split across devices by device_map is not supported)")
            step = self.step
            if layer.index == 0:
                if batch > self.max_batch_size:
                    raise ValueError(f"batch of {batch} requests over the PagedCache's max_batch_size "
                                     f"{self.max_batch_size}")
                if self.seen + q_len > self.max_cache_len:
                    raise ValueError(f"PagedCache holds {self.max_cache_len} positions a request; this forward needs "
                                     f"{self.seen + q_len} (padding included)")
                step.begin(attention_mask, batch, q_len, self.seen)
                self.seen += q_len
            elif (batch, q_len) != (step.batch, step.q_len):
                raise ValueError(f"layer {layer.index}: batch {batch} x {q_len} new tokens, while this forward's first "
                                 f"layer had {step.batch} x {step.q_len}")

        def _attention(self, layer, q: torch.Tensor, batch: int, q_len: int, scaling: float | None) -> torch.Tensor:
            """q ``[B * T, Hq, D]`` over the layer's pages (its new K / V stored): ``[B * T, Hq, D]``."""
            step, table = self.step, self.step.table(batch)
            if q_len == 1:
                return evenflow.decode_attention(q, layer.keys, layer.values, table, step.lens, plan=step.plan,
                                                 k_scale=self.k_scale, v_scale=self.v_scale, sm_scale=scaling)
            return evenflow.prefill_attention(q, layer.keys, layer.values, step.cu_q, table, step.lens, q_len,
                                              k_scale=self.k_scale, v_scale=self.v_scale, sm_scale=scaling)

        def attend(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
            """Store this forward's K / V of ``layer`` and attend; query ``[B, Hq, T, D]``, key / value ``[B, Hkv, T,
            D]`` (transformers' layout); returns ``[B, T, Hq, D]``."""
            B, hq, T, d = query.shape
            if (hq, d) != (self.num_q_heads, self.head_dim) or tuple(key.shape) != (B, self.num_kv_heads, T, d):
                raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)} do not match the cache's "
                                 f"{self.num_q_heads} q heads, {self.num_kv_heads} kv heads, head_dim {self.head_dim}")
            if query.dtype != torch.bfloat16:
                raise TypeError(f"query: evenflow's paged attention computes in bf16, got {query.dtype} (load the "
                                "model in torch.bfloat16)")
            self._enter(layer, B, T, attention_mask, query.device)
            rows = B * T
            store_kv(key.transpose(1, 2).reshape(rows, self.num_kv_heads, d),
                     value.transpose(1, 2).reshape(rows, self.num_kv_heads, d), layer.keys, layer.values,
                     self.step.slots(), k_scale=self.k_scale, v_scale=self.v_scale)
            return self._attention(layer, query.transpose(1, 2).reshape(rows, hq, d), B, T, scaling).view(B, T, hq, d)

        def attend_fused(self, module, qkv: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
            """The fused form (``enable_attention(..., fuse_prologue=True)``): ``qkv`` ``[B, T, (Hq + 2 Hkv) D]``,
            the module's fused projection; one ``qk_norm_rope_store_kv`` (QK-norm, rotation at each token's index
            among its request's real tokens, the store) and the attention. Returns ``[B, T, Hq * D]``."""
            B, T, width = qkv.shape
            hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
            if qkv.dtype != torch.bfloat16:
                raise TypeError(f"qkv: evenflow's paged attention computes in bf16, got {qkv.dtype} (load the model "
                                "in torch.bfloat16)")
            if width != (hq + 2 * hkv) * d:
                raise ValueError(f"qkv {tuple(qkv.shape)}: expected [B, T, {(hq + 2 * hkv) * d}] for the cache's "
                                 f"{hq} q heads, {hkv} kv heads, head_dim {d}")
            layer = self.layers[module.layer_idx]
            self._enter(layer, B, T, attention_mask, qkv.device)
            step = self.step
            q, _ = evenflow.qk_norm_rope_store_kv(
                qkv.view(B * T, width), step.store_pos, self.rope_table, layer.keys, layer.values,
                step.page_table[:B], step.cu_q, q_norm_weight=module.q_norm.weight, k_norm_weight=module.k_norm.weight,
                eps=module.q_norm.variance_epsilon, rotary_dim=self.rope_table.shape[1], k_scale=self.k_scale,
                v_scale=self.v_scale)
            return self._attention(layer, q, B, T, module.scaling).view(B, T, hq * d)

    return PagedCache


_PAGED_CACHE_DOC = """A transformers ``Cache`` of paged K / V for evenflow's attention (``enable_attention``).

    ``PagedCache(model, max_batch_size, max_cache_len, *, page_size=64, max_tokens=None, kv_dtype=None, k_scale=None,
    v_scale=None, plan=True, device=None, **plan_options)``: ``max_cache_len`` positions a request (prompt padding
    included, as the model counts positions; only real tokens are stored). The pages come from one pool of
    ``max_tokens`` tokens (default ``max_batch_size`` x ``max_cache_len``, rounded up to pages), handed to each request
    as its real tokens need them: a prompt's real lengths are read once (the prompt's one host sync), a decode step
    takes a page for a request whose bound crosses into one (no sync), so a batch of unequal prompts needs a pool of
    about its real tokens plus the new ones, not the padded rectangle; an exhausted pool raises. Memory:
    ``layers x (max_tokens + page_size) x kv_heads x head_dim x 2 (K, V) x kv_dtype's bytes``, per layer ``[pages + 1,
    page_size, kv_heads, head_dim]`` (the last page a spare that padding rows write to) in ``kv_dtype`` (bf16 by
    default; ``torch.float8_e4m3fn`` stores K / ``k_scale`` and V / ``v_scale``, saturated, and the kernels multiply
    back). ``plan``: decode steps run on a :class:`evenflow.DecodePlan` (``plan_options``
    go to it), updated once a step; ``False``: the static split-KV schedule. ``seq_lens``: each request's cached
    tokens. A new batch of prompts needs :meth:`reset` (or a new cache)."""


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for ``model(...)`` / ``model.generate(...)``: ``cache``, the keyword of the transformers
    releases this adapter runs on (>= 5.24), unless the model's forward takes ``past_key_values`` and no ``cache`` (a
    model class not yet moved over). A ``torch.compile``d model is read through the module it wraps (its own forward
    takes ``*args, **kwargs``)."""
    module = getattr(model, "_orig_mod", model)
    forward = getattr(module, "forward", None)
    params = inspect.signature(forward).parameters if forward is not None else {}
    old = "past_key_values" in params and "cache" not in params
    return {"past_key_values" if old else "cache": cache}


def __getattr__(name: str):
    """``PagedCache`` / ``PagedLayer`` are built on first use (transformers is imported only then)."""
    if name == "PagedCache":
        return _cache_class()
    if name == "PagedLayer":
        return _layer_class()
    raise AttributeError(name)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention function ``"evenflow"``: returns ``(out [B, T, Hq, D], None)``."""
    layer = kwargs.get(_HANDLE)
    if layer is None:
        raise ValueError(f"{type(module).__name__}: attn_implementation 'evenflow' needs "
                         "cache=evenflow.integrations.transformers.PagedCache(...) (past_key_values= before "
                         "transformers 5.2x) and use_cache=True")
    layer.owner.unattended = None  # the handle taken: the next update finds no layer left out
    if dropout:
        raise ValueError(f"{type(module).__name__}: dropout {dropout}: evenflow's paged attention is for inference")
    if kwargs.get("use_cache") is False:
        raise ValueError(f"{type(module).__name__}: use_cache=False with a PagedCache: every call would store its "
                         "tokens again; generate with use_cache=True")
    if getattr(module, "is_causal", True) is False:
        raise TypeError(f"{type(module).__name__}: not causal; evenflow's paged attention is causal")
    window = kwargs.get("sliding_window")
    if window is not None and window < layer.owner.max_cache_len:
        raise TypeError(f"{type(module).__name__}: sliding window {window} under the cache's "
                        f"{layer.owner.max_cache_len} positions; evenflow's paged attention computes full causal "
                        "attention")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise TypeError(f"{type(module).__name__}: {name} is not computed by evenflow's paged attention")
    if getattr(module, "sinks", None) is not None:
        raise TypeError(f"{type(module).__name__}: attention sinks are not computed by evenflow's paged attention")
    refuse_autograd(module, (query, key, value))
    return layer.owner.attend(layer, query, key, value, attention_mask, scaling), None


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask function ``"evenflow"``: the 2-D padding mask [B, kv_length] as it is (the kernels are
    causal by construction and read each request's real tokens only), or None. Any mask pattern other than plain
    causal (bidirectional, a sliding window, packed sequences, a model's own overlay such as an image prefix)
    raises: the kernels would compute causal attention in its place."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        raise TypeError(f"attention mask pattern {getattr(mask_function, '__name__', mask_function)!r}: evenflow's "
                        "paged attention computes plain causal attention only")
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def register_attention() -> None:
    """Register ``"evenflow"`` with transformers' attention and mask interfaces (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(f"{NEEDS}: {e}") from e
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask)


def enable_attention(model: torch.nn.Module, *, fuse_prologue: bool = True) -> dict:
    """Put ``model``'s attention on evenflow (``attn_implementation "evenflow"``); generate or call it with
    ``cache=PagedCache(model, ...)``. With ``fuse_prologue``, each attention module of Qwen3-MoE's form (its
    ``forward``'s code: Qwen2/3-MoE, Qwen3, ... in transformers 5.25) also gets evenflow's forward on the instance:
    one GEMM over its q / k / v projections (concatenated once and held: the projections' weights a second time in
    memory), then ``qk_norm_rope_store_kv`` (QK-RMSNorm, the rotation from the model's own rotary table, the store)
    in one kernel where the stock forward runs its norms, rotation and transposes as separate eager ops and the
    unfused adapter adds the store's copies (about 20 launches a layer, counted from the code); none where the
    model's rotary embedding is not one fixed table (dynamic or longrope scaling, multimodal sections). A module
    changed after this call (a projection replaced or wrapped, a hook on a projection or norm) runs its own forward
    again. Returns ``{"fused_prologue": n}``, the modules that got it. Raises ``TypeError`` for a model whose
    attention the kernels do not compute (see the module docstring)."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model: {type(model).__name__} is not a transformers PreTrainedModel")
    if not isinstance(fuse_prologue, bool):
        raise TypeError(f"fuse_prologue must be a bool, got {type(fuse_prologue).__name__}")
    _attention_dims(_config_of(model))
    register_attention()
    model.set_attn_implementation(IMPLEMENTATION)
    fused = 0
    if fuse_prologue and _rotary(model) is not None:  # (no usable rotary table: every call would run unfused)
        for m in model.modules():
            if _fusable(m) and not is_fused_attention(m):
                m.forward = types.MethodType(_fused_attention_forward, m)
                fused += 1
    return {"fused_prologue": fused}
