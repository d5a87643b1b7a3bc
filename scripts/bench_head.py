"""`python scripts/bench_head.py`: the op-level benchmark of the fused head + cross-entropy
(measure/bench_head.py says how)."""

from measure import bench_head

if __name__ == "__main__":
    bench_head.main()
