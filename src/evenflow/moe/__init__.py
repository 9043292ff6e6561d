"""evenflow.moe: public names of this operator family (re-exported by evenflow)."""

__all__: list[str] = []
