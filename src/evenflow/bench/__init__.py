"""Benchmark support: the shared harness (``harness``) and peer adapters (``peers``).

Ships with the package so that ``evenflow bench`` and ``evenflow demo`` can time
operators beside their peers from an installed wheel.
"""
