"""Does the process state move amx-vs-dense at 128 tokens? q/o and gate/up shapes timed as the dispatcher times them
(dense against cpu-amx-bf16 alone), fresh, with ~4.4 GB of bf16 weights held (two TinyLlama models), and after
freeing them (cpu24-notes.md §53)."""
import torch

from cast_llm.deploy.sparse24.cpu import huge_pages_reason
from cast_llm.deploy.sparse24.timing import measure_gemms_rounds

torch.set_num_threads(2)
cpu = torch.device("cpu")
def t(label):
    for (o, i) in [(2048, 2048), (5632, 2048)]:
        got = measure_gemms_rounds(["dense", "cpu-amx-bf16"], o, i, torch.bfloat16, 128, "eager", cpu)
        d, a = got["dense"], got["cpu-amx-bf16"]
        rr = [x / y for x, y in zip(d[2], a[2])]
        print(f"{label} {o}x{i} 128 tok: dense {d[0]*1e6:.0f} us amx {a[0]*1e6:.0f} us ratio {d[0]/a[0]:.2f} rounds {[round(x,2) for x in rr]}", flush=True)
print("huge pages:", huge_pages_reason())
t("fresh")
# ~4.4 GB of bf16 held, as two models
held = [torch.randn(5632, 2048).bfloat16() for _ in range(2 * 1100 * 10**6 // (5632 * 2048))]
x = torch.randn(128, 2048).bfloat16()
for w in held:
    torch.nn.functional.linear(x, w)
t("with 4.4 GB held")
del held
t("after freeing it")
