"""Peer adapters: other libraries' operators, wrapped so a benchmark can time them beside ours.

One module per peer library. An adapter builds the peer once for a given problem
(layout conversion, planning, JIT build) outside any timed region and hands back a
zero-argument callable that runs it. When the peer cannot run here (not installed,
fails to build, rejects the inputs) it raises
:class:`evenflow.bench.harness.PeerUnavailable` with the reason; the benchmark
script turns that into a result row with an ``error`` field instead of crashing.

Adapters never hold evenflow math and evenflow never imports them outside
benchmarks and the demo.
"""
