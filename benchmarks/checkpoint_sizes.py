"""On-disk size of a 2:4 model in every checkpoint format vs its dense HF checkpoint (method.md §7).

    python benchmarks/checkpoint_sizes.py --model smollm2-135m --work /tmp/sizes [--sparse PATH]

Without ``--sparse`` the model is magnitude-pruned to 2:4 first (sizes do not depend on which weights are
kept). For fp16 and fp32 it writes: the dense hf checkpoint, the 2:4 model as hf / compressed /
compressed-tensors, and 4- and 3-bit RTN packed checkpoints; every written format is read back and
compared with the model. Prints a Markdown table of measured file sizes (all *.safetensors of a folder)
and of the target tensors alone (from the index files), with the theory for 2:4 targets.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import torch


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sparse", default=None, help="an already 2:4 version of --model (default: magnitude)")
    ap.add_argument("--work", required=True, help="scratch folder (deleted and recreated)")
    args = ap.parse_args()

    from cast_llm.deploy.compressed import load_compressed, on_disk_bytes, save_compressed
    from cast_llm.deploy.compressed_tensors import load_compressed_tensors, save_compressed_tensors
    from cast_llm.deploy.export import save_sparse_checkpoint
    from cast_llm.models import load_model, load_tokenizer
    from cast_llm.prune.magnitude import magnitude_prune_
    from cast_llm.quant import quantize_model_
    from cast_llm.quant.pack import load_quantized, save_quantized
    from cast_llm.targets import find_targets

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tok = load_tokenizer(args.model)
    rows = []
    for dtype, name in ((torch.float16, "fp16"), (torch.float32, "fp32")):
        dense = load_model(args.model, dtype=dtype)
        dense.save_pretrained(work / f"dense-{name}")
        dense_bytes = on_disk_bytes(work / f"dense-{name}")["total"]
        if args.sparse:
            sparse = load_model(args.sparse, dtype=dtype)
        else:
            sparse = dense
            with torch.no_grad():
                for t in find_targets(sparse):
                    magnitude_prune_(t.weight.t() if t.transposed else t.weight, 2, 4)
        targets = find_targets(sparse)
        target_dense = sum(t.weight.numel() * t.weight.element_size() for t in targets)
        rows.append((name, "dense hf (reference)", dense_bytes, dense_bytes, target_dense, target_dense))

        def check(a, b, what):
            sa, sb = a.state_dict(), b.state_dict()
            assert all(torch.equal(sa[k], sb[k]) for k in sa), f"{what} did not round-trip"

        out = save_sparse_checkpoint(sparse, tok, work / f"hf-{name}", method="magnitude")
        check(sparse, load_model(str(out), dtype=dtype), "hf")
        rows.append((name, "2:4 hf (exact zeros)", on_disk_bytes(out)["total"], dense_bytes, target_dense,
                     target_dense))
        out = save_compressed(sparse, tok, work / f"compressed-{name}")
        check(sparse, load_compressed(out), "compressed")
        idx = json.loads((out / "compressed_index.json").read_text())
        rows.append((name, "2:4 compressed (values + 2-bit indices)", on_disk_bytes(out)["total"], dense_bytes,
                     idx["bytes"]["targets_compressed"], target_dense))
        out = save_compressed_tensors(sparse, tok, work / f"ct-{name}")
        check(sparse, load_compressed_tensors(out), "compressed-tensors")
        ct_targets = target_dense // 2 + sum(t.weight.numel() // 8 for t in targets)  # values + 1-bit mask
        rows.append((name, "2:4 compressed-tensors (sparse-24-bitmask)", on_disk_bytes(out)["total"],
                     dense_bytes, ct_targets, target_dense))
        if name == "fp16":
            for bits in (4, 3):
                q = copy.deepcopy(sparse).float()
                res = quantize_model_(q, method="rtn", bits=bits)
                q.to(dtype)
                out = save_quantized(q, res, tok, work / f"w{bits}-{name}")
                check(q, load_quantized(out), f"w{bits}")
                packed = json.loads((out / "quant_index.json").read_text())["bytes"]["targets_packed"]
                rows.append((name, f"2:4 + {bits}-bit packed (codes, positions, scales, zeros)",
                             on_disk_bytes(out)["total"], dense_bytes, packed, target_dense))
        del dense, sparse

    print("| dtype | format | file MiB | × dense file | target MiB | × dense targets |")
    print("|---|---|---:|---:|---:|---:|")
    for name, fmt, size, dense_size, tbytes, tdense in rows:
        print(f"| {name} | {fmt} | {mib(size)} | {size / dense_size:.4f} | {mib(tbytes)} | {tbytes / tdense:.4f} |")


if __name__ == "__main__":
    main()
