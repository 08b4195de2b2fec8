"""Cluster benchmarks (`task=bench`): collectives, point-to-point links, GEMM, a short training run.

Every rank measures; the report rank gathers the records and writes `bench.json`,
`bench_report.md` and plots, naming the nodes that fall behind their peers.
"""
