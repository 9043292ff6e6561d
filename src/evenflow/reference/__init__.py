"""Plain PyTorch oracles, one module per operator, computing in fp32/fp64.

They are deliberately simple (loops over requests/experts, no fusion) so that a
reader can check them by eye; tests compare every kernel against them.
"""
