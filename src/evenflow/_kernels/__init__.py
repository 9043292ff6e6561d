"""Pure ``@triton.jit`` helpers shared by several operators (no torch logic)."""
