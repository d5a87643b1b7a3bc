"""`python scripts/memory_peak.py`: what is alive at the peak of a CUDA memory snapshot
(measure/memory_peak.py says how)."""

from measure import memory_peak

if __name__ == "__main__":
    memory_peak.main()
