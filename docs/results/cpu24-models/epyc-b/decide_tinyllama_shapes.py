import torch

from cast_llm.deploy.sparse24.dispatch import Dispatcher

shapes = [(2048, 2048), (256, 2048), (5632, 2048), (2048, 5632)]
for rep in range(3):
    for (o, i) in shapes:
        d = Dispatcher(device=torch.device("cpu"))
        r = d.decide(o, i, torch.bfloat16, 1, "eager", ["dense", "dense-careful", "cpu-avx512-bf16", "cpu-avx512", "cpu-avx2"])
        print(rep, o, i, r.kernel, {k: round(v * 1e6, 1) for k, v in r.seconds.items()}, flush=True)
