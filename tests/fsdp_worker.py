"""Run under torchrun (gloo, CPU) by tests/test_train.py: AdamS masks of row-sharded (FSDP2-style) DTensor
parameters equal the masks of the full tensors, restricted to each rank's rows (uneven shards included).

Prints "OK <rank>" on success; any failed check raises (non-zero exit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from cast_llm.optim import AdamS
from cast_llm.sparsity.mask import nm_mask
from cast_llm.train import fsdp


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    # (out, in) weights sharded by rows (FSDP2's Shard(0)); 7 rows: uneven shards (4 + 3 on 2 ranks); one
    # weight with many exact ties (quantised values), where a tie-break on a different tensor could differ
    full_ws = [torch.randn(7, 16, generator=g), torch.randn(8, 32, generator=g),
               (torch.randn(6, 8, generator=g) * 2).round() / 2]
    # a Conv1D-style (in, out) weight, groups along dim 0: sharded along dim 1 (what --fsdp does for it)
    full_t = torch.randn(16, 6, generator=g)
    params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for w in full_ws]
    tparam = torch.nn.Parameter(distribute_tensor(full_t, mesh, [Shard(1)]))
    opt = AdamS([{"params": params, "sparse": True}, {"params": [tparam], "sparse": True, "transposed": True}],
                lr=0.05, l1_decay=1e-2, total_steps=6, mask_interval=1)
    names = {id(p): f"w{i}" for i, p in enumerate(params + [tparam])}
    for step in range(6):
        for p in params + [tparam]:
            gfull = torch.randn(p.shape, generator=g)  # identical on every rank
            p.grad = distribute_tensor(gfull, mesh, p.placements)
        before = {id(p): p.full_tensor().detach().clone() for p in params + [tparam]}
        opt.step()  # mask_interval=1: the masks of this step are Eq. 6 of the weights before it
        for p in params:
            expected = nm_mask(before[id(p)], 2, 4)
            assert torch.equal(distribute_tensor(expected, mesh, [Shard(0)], src_data_rank=None).to_local(),
                               opt.mask(p)), (step, tuple(p.shape))
        expected_t = nm_mask(before[id(tparam)].t(), 2, 4).t()
        assert torch.equal(distribute_tensor(expected_t, mesh, [Shard(1)], src_data_rank=None).to_local(),
                           opt.mask(tparam)), step
        # gathered on rank 0, the masks are the full-tensor masks
        gathered = fsdp.gather_masks(opt, names, rank == 0)
        if rank == 0:
            for p in params:
                assert torch.equal(gathered[names[id(p)]], nm_mask(before[id(p)], 2, 4)), step
            assert torch.equal(gathered[names[id(tparam)]], expected_t), step
    # a full-tensor mask given for a sharded parameter (--init-mask wanda/sparsegpt) keeps the local rows
    p = params[0]
    full_mask = nm_mask(-p.full_tensor().detach(), 2, 4)
    opt.set_mask(p, full_mask)
    assert torch.equal(opt.mask(p), distribute_tensor(full_mask, mesh, [Shard(0)], src_data_rank=None).to_local())
    # exact round trip of the optimizer state through the per-rank checkpoint form (masks included)
    state = fsdp.local_optimizer_state(opt)
    masks = {id(q): m.clone() for q, m in opt.masks().items()}
    opt2 = AdamS([{"params": params, "sparse": True}, {"params": [tparam], "sparse": True, "transposed": True}],
                 lr=0.05, l1_decay=1e-2, total_steps=6, mask_interval=1, mask_storage="packed")
    fsdp.load_local_optimizer_state(opt2, state)
    for q, m in opt2.masks().items():
        assert torch.equal(m, masks[id(q)])
        assert torch.equal(opt2.state[q]["exp_avg"].to_local(), opt.state[q]["exp_avg"].to_local())
        assert type(opt2.state[q]["exp_avg"]).__name__ == "DTensor"
    print(f"OK {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
