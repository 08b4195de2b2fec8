"""CPU overhead of FP8 linears: one hpctrain linear, forward + backward under bf16 autocast,
on one thread, bf16 (torch's F.linear) vs FP8 tensorwise and rowwise (hpctrain.ops.fp8).
CPU has no float8 units (torch._scaled_mm dequantizes to fp32 here), so this measures the
price of the exact emulation, not a speed-up; the GPU numbers come from
benchmarks/gpu/run.sh (section fp8). Prints a markdown table: median ms and ratio to bf16.

    python benchmarks/bench_fp8.py --tokens 2048 --in-features 512 --out-features 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hpctrain.ops.fp8 import Fp8Spec
from hpctrain.ops.linear import linear


def _median_s(fn, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--in-features", type=int, default=512)
    p.add_argument("--out-features", type=int, default=2048)
    p.add_argument("--iters", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.tokens, args.in_features, requires_grad=True)
    w = torch.randn(args.out_features, args.in_features, requires_grad=True)
    dy = torch.randn(args.tokens, args.out_features)

    def step(spec):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x, w, fp8=spec)
        y.backward(dy.to(y.dtype))

    variants = {"bf16": None, "fp8 tensorwise": Fp8Spec("tensorwise"),
                "fp8 rowwise": Fp8Spec("rowwise")}
    ms = {k: 1e3 * _median_s(lambda s=s: step(s), warmup=2, iters=args.iters)
          for k, s in variants.items()}
    print("| path | fwd+bwd ms | vs bf16 |\n|---|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.1f} | {v / ms['bf16']:.2f}× |")


if __name__ == "__main__":
    main()
