"""Shared by the engine adapters' tests (vLLM, SGLang): the K / V rows a test kept for every request (not read from the
engine's cache), the fp64 oracle of one step's attention over them, the rows as an fp8 cache holds them, and SGLang's
import."""
import importlib.abc
import importlib.machinery
import importlib.util
import math
import sys
import types

import torch

from evenflow.reference.attention import prefill_attention_ref

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FP8_MAX = 448.0


class RowLog:
    """Each layer's K / V rows of each request so far, as a test handed them to the engine: the oracle's view of the
    cache, kept apart from it (copies: an engine's store may write the rows it is handed, SGLang's fp8 one does)."""

    def __init__(self):
        self.kv: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def length(self, r):
        return 0 if (0, r) not in self.kv else self.kv[0, r][0].shape[0]

    def append(self, sched, k, v, layer=0):
        """``sched``: [(request, new tokens)] in the step's row order; ``k`` / ``v`` the step's rows."""
        at = 0
        for r, n in sched:
            kk, vv = k[at:at + n].cpu().clone(), v[at:at + n].cpu().clone()
            if (layer, r) in self.kv:
                kk, vv = torch.cat([self.kv[layer, r][0], kk]), torch.cat([self.kv[layer, r][1], vv])
            self.kv[layer, r] = (kk, vv)
            at += n


def quantised(x, scale, kv_dtype):
    """The rows as the cache holds them: fp8 at the per-tensor scale (as a store quantises), or as given."""
    if kv_dtype != FP8:
        return x
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def step_oracle(rows, new_tokens, q, page, kv_dtype, k_scale, v_scale, sm_scale, store=quantised):
    """fp64 oracle and fp32 baseline (bf16 P and output) of one step: request i's cached rows ``rows[i]`` (K, V
    ``[L_i, Hkv, D]``, this step's included) laid in one contiguous page table of a fresh cache (no engine layout,
    no slot arithmetic), its last ``new_tokens[i]`` rows the queries ``q`` (all requests' in order). ``store``: the
    rows as the engine's cache holds them (``quantised``'s rounding, or the engine's own, at the scales)."""
    lens = [k.shape[0] for k, _ in rows]
    pages = [math.ceil(L / page) for L in lens]
    hkv, d = rows[0][0].shape[1:]
    k_c = torch.zeros(sum(pages), page, hkv, d, dtype=kv_dtype)
    v_c = torch.zeros_like(k_c)
    table = torch.zeros(len(rows), max(pages), dtype=torch.int32)
    flat_k, flat_v = k_c.view(-1, hkv, d), v_c.view(-1, hkv, d)
    at = 0
    for i, (kk, vv) in enumerate(rows):
        flat_k[at * page:at * page + lens[i]] = store(kk, k_scale, kv_dtype)
        flat_v[at * page:at * page + lens[i]] = store(vv, v_scale, kv_dtype)
        table[i, :pages[i]] = torch.arange(at, at + pages[i])
        at += pages[i]
    cu = torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = dict(k_scale=k_scale if kv_dtype == FP8 else None, v_scale=v_scale if kv_dtype == FP8 else None,
              sm_scale=sm_scale)
    ref, _ = prefill_attention_ref(q.cpu(), k_c, v_c, cu, table, sl, **kw)
    base, _ = prefill_attention_ref(q.cpu(), k_c, v_c, cu, table, sl, dtype=torch.float32, p_dtype=BF16,
                                    out_dtype=BF16, **kw)
    return ref, base


class _Inert(types.ModuleType):
    """A placeholder module: any attribute is another placeholder; calling one raises (nothing under test may)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a test placeholder for a missing package: it was called")


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def import_sglang() -> bool:
    """Import SGLang's modules the SGLang adapter and its tests use, and the adapter; False if SGLang is missing.

    SGLang's import chain reaches two packages its attention interface never calls: torchvision (its multimodal
    configs import it at module level) and, on a CUDA machine, its CUDA kernel package sgl_kernel (its quantisation
    schemes import it at module level). torchvision has no build for a CPU-only torch on the package index CI uses
    (its wheels link CUDA), and sgl_kernel's wheel is far larger than what a GPU call of ours carries; so where one is
    not installed it is served, for this import only, as inert placeholder modules that raise if called (a test
    reaching one fails, naming it); the import hook and the modules are removed afterwards, so nothing else sees
    them. transformers' torchvision check, which SGLang's import also reaches, is asked first, so it caches the
    truth (absent)."""
    if importlib.util.find_spec("sglang") is None:
        return False
    missing = [m for m in ("torchvision", "sgl_kernel") if importlib.util.find_spec(m) is None]
    finder = None
    if missing:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        finder = _InertFinder(set(missing))
        sys.meta_path.insert(0, finder)
    try:
        importlib.import_module("sglang.srt.layers.attention.attention_registry")
        importlib.import_module("sglang.srt.model_executor.model_runner_components.attention_backend_setup")
        importlib.import_module("sglang.srt.model_executor.forward_context")
        importlib.import_module("evenflow.integrations.sglang")
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n.split(".")[0] in finder.roots]:
                del sys.modules[name]
    return True
