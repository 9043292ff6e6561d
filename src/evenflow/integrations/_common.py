"""What the transformers adapters share: judging a module's code by its source, state derived from a module's
parameters and held on it until they change, and the refusal of calls autograd would record."""
from __future__ import annotations

import inspect
import re
from typing import Callable, Iterable

import torch

# the attributes under which the adapters hold state derived from a module's parameters (:func:`held`)
HELD_ATTRS = ("_evenflow_split", "_evenflow_moe", "_evenflow_qkv")


def normalised_source(fn) -> str | None:
    """``fn``'s code without its first line (its decorator or signature), docstrings, comments and indentation (None
    where it has no source): two forwards compute the same where these are equal and call the same helpers."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    src = re.sub(r'"""[\s\S]*?"""', "", src)
    return "\n".join(line.strip() for line in src.splitlines()[1:] if line.strip() and not line.strip().startswith("#"))


def _stamp(t: torch.Tensor) -> tuple:
    try:
        version = t._version
    except RuntimeError:  # an inference tensor keeps no version counter: in-place writes need refresh()
        version = -1
    return id(t), t.data_ptr(), t.dtype, t.device, version


def held(module: torch.nn.Module, attr: str, tensors: Iterable[torch.Tensor | None], build: Callable[[], object]):
    """What ``build()`` derives from ``tensors`` (the module's parameters), held on the module under ``attr`` and
    built again when any of them is replaced, moved or cast (``model.to``) or written in place (its version counter;
    writes through ``.data`` or into inference tensors bump none: :func:`refresh`). Built outside inference mode, so
    it serves calls in and out of it."""
    stamp = tuple(_stamp(t) for t in tensors if t is not None)
    kept = module.__dict__.get(attr)
    if kept is None or kept[0] != stamp:
        with torch.no_grad(), torch.inference_mode(False):
            kept = (stamp, build())
        module.__dict__[attr] = kept
    return kept[1]


def refresh(model: torch.nn.Module) -> None:
    """Drop everything the adapters hold on ``model``'s modules, so the next call builds it from the weights as they
    are (after writes through ``.data``, which no version counter sees, or to free the old tensors after moving the
    model at once)."""
    for m in model.modules():
        for attr in HELD_ATTRS:
            m.__dict__.pop(attr, None)


def refuse_autograd(module: torch.nn.Module, tensors: Iterable[torch.Tensor]) -> None:
    """RuntimeError where a call autograd would record reaches evenflow's kernels (they have no backward)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{type(module).__name__}: evenflow's kernels have no backward; call the model under "
                           "torch.no_grad() or torch.inference_mode() (as generate() does), or freeze its weights")
