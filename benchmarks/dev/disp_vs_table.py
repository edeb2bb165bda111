"""Does the dispatcher's interleaved timing agree with timing each kernel alone? (docs/results/cpu24-notes.md §18)

SmolLM2-135M's fp32 shapes at 128 tokens, dense ``F.linear`` against the ``cpu-avx512`` 2:4 kernel, three rounds a
shape: once through ``measure_gemms`` (interleaved, the dispatcher's) and once each through ``cycled_seconds``.

    python benchmarks/dev/disp_vs_table.py 2      # threads
"""

from __future__ import annotations

import sys

import torch

from cast_llm.deploy.sparse24.timing import cycled_seconds, measure_gemms


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    dt, cpu = torch.float32, torch.device("cpu")
    for o, i in [(576, 576), (192, 576), (1536, 576), (576, 1536)]:
        for r in range(3):
            m = measure_gemms(["dense", "cpu-avx512"], o, i, dt, 128, "eager", cpu)
            d_sep, s_sep = cycled_seconds("dense", o, i, dt, 128), cycled_seconds("cpu-avx512", o, i, dt, 128)
            d_int, s_int = m["dense"][0], m["cpu-avx512"][0]
            print(f"{o}x{i} r{r}: interleaved dense {d_int * 1e6:.0f} us sparse {s_int * 1e6:.0f} us ratio "
                  f"{d_int / s_int:.2f} | separate dense {d_sep * 1e6:.0f} sparse {s_sep * 1e6:.0f} ratio "
                  f"{d_sep / s_sep:.2f}", flush=True)


if __name__ == "__main__":
    main()
