"""evenflow: workload-aware Triton operators for Mixture-of-Experts serving.

Importing evenflow on a machine without CUDA switches Triton to its CPU
interpreter (see ``evenflow._runtime``) so every operator still runs, slowly.
"""
from evenflow._runtime import select_backend as _select_backend

_select_backend()

from evenflow.attention import *  # noqa: E402,F403
from evenflow.attention import __all__ as _attention_all  # noqa: E402
from evenflow.moe import *  # noqa: E402,F403
from evenflow.moe import __all__ as _moe_all  # noqa: E402
from evenflow.router import *  # noqa: E402,F403
from evenflow.router import __all__ as _router_all  # noqa: E402

__version__ = "0.1.0"
__all__ = [*_attention_all, *_router_all, *_moe_all]
