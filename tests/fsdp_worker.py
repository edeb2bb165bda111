"""Run under torchrun (gloo, CPU, 2 processes) by tests/test_train.py. Checks, in one launch:

* AdamS masks of row-sharded (FSDP2-style) DTensor parameters equal the masks of the full tensors,
  restricted to each rank's rows (uneven shards included);
* a sharded model loaded by rank 0 alone: rank 1 builds it empty (every parameter on the meta device, no
  whole tensor ever allocated), and after the broadcast each rank holds exactly its shards, equal to the
  full model's rows; the teacher likewise, cast to bf16;
* gradient accumulation under FSDP2 as the loop runs it: after a micro-batch that is not the last, every
  rank's gradients are its shards (no whole gradient anywhere), and the accumulated gradients equal those of
  the whole batch in one process;
* ``--fsdp-precision policy`` (FSDP2's MixedPrecisionPolicy) on a weight-scaled student: the master shards
  are fp32 DTensors split by rows — every rank's rows hold whole 2:4 groups (all the columns) — the scales
  whole fp32 tensors on every rank, each scaled weight formed again in backward rather than kept; the
  forward runs without autocast on bf16 weights; the gradients
  (reduce-scattered in fp32, the scales' averaged by one all-reduce) equal one process's computed in the
  same precision (bf16 weights, fp32 scales) within bf16 rounding, and are measurably closer to it than to
  fp32's; clipping's global norm counts the replicated scales once;
* rank 0's error inside ``waiting_for_main`` reaches rank 1 as one line; a checkpoint that fails on rank 0
  alone (its publishing) fails on every rank, and the previous checkpoint stays.

Prints "OK <rank>" on success; any failed check raises (non-zero exit).
"""

from __future__ import annotations

import copy
import sys
import tempfile
import types
from pathlib import Path

import tiny
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from cast_llm.errors import CastError
from cast_llm.models import empty_model
from cast_llm.nn import ScaledLinear, wrap_scaling_
from cast_llm.optim import AdamS
from cast_llm.sparsity.mask import nm_mask
from cast_llm.targets import find_targets
from cast_llm.train import fsdp
from cast_llm.train.checkpoint import CheckpointWriteError, list_checkpoints
from cast_llm.train.distributed import Sharded


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    check_masks(rank, mesh)
    check_sharded_load_and_accumulation(rank, world, mesh)
    check_policy(rank, world, mesh)
    check_errors_reach_every_rank(rank, world, Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"OK {rank}", flush=True)
    dist.destroy_process_group()


def check_masks(rank, mesh) -> None:
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


def _distribution(rank, world) -> Sharded:
    """The loop's FSDP2 strategy over the initialised process group (a stand-in for the accelerator)."""
    acc = types.SimpleNamespace(is_main_process=rank == 0, num_processes=world, process_index=rank,
                                device=torch.device("cpu"), wait_for_everyone=dist.barrier)
    return Sharded(acc, wait_timeout_s=120)


def check_sharded_load_and_accumulation(rank, world, mesh) -> None:
    d = _distribution(rank, world)
    d.mesh = mesh
    cfg = types.SimpleNamespace(n=2, m=4, skip_incompatible=False, model="tiny")
    reference = tiny.model("llama", num_hidden_layers=2, intermediate_size=96)  # (for the checks only)
    config = reference.config
    if rank == 0:
        model = tiny.model("llama", num_hidden_layers=2, intermediate_size=96)  # rank 0 alone loads it
    else:
        model = empty_model("tiny", config=config)
        assert all(p.device.type == "meta" for p in model.parameters())  # no whole tensor on rank 1, ever
    d.shard(model, None, cfg, say=lambda *a: None, fill=True)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(p, DTensor) and p.to_local().numel() < q.numel(), name
        assert torch.equal(p.full_tensor(), q), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    # the teacher: built empty on every rank, filled from rank 0's dense model, cast to bf16 tensor by tensor
    import cast_llm.train.distributed as distributed

    distributed.empty_model = lambda name, dtype: empty_model(name, dtype=dtype, config=config)
    teacher = d.build_teacher(reference if rank == 0 else None, cfg, torch.bfloat16, say=None)
    for (name, p), (_, q) in zip(teacher.named_parameters(), reference.named_parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p.full_tensor(), q.bfloat16()), name

    # gradient accumulation, two micro-batches, as the loop runs it (distribution.no_sync, then backward)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, tiny.VOCAB, (world, 16), generator=g) for _ in range(2)]
    for micro, batch in enumerate(batches):
        with d.no_sync(model, micro == 1):
            loss = model(input_ids=batch[rank : rank + 1], labels=batch[rank : rank + 1]).loss
            (loss / 2).backward()
        if micro == 0:  # between micro-batches: each rank holds its gradient shards, nothing whole
            for name, p in model.named_parameters():
                assert isinstance(p.grad, DTensor) and p.grad.to_local().shape == p.to_local().shape, name
    ref_loss = sum(reference(input_ids=b, labels=b).loss for b in batches) / 2  # the whole batch, one process
    ref_loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6, msg=name)


def _scaled_reference():
    """A tiny weight-scaled LLaMA with scales away from 1, as a trained student has them (uneven shards are
    :func:`check_masks`' business)."""
    model = tiny.model("llama", num_hidden_layers=2, hidden_size=48, intermediate_size=104, num_attention_heads=4,
                       num_key_value_heads=2)
    wrap_scaling_(model, n_groups=2, m=4)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ScaledLinear):
                m.scale.copy_(1 + 0.2 * torch.randn(m.scale.shape, generator=g))
    return model


def _grads_of(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch).loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_policy(rank, world, mesh) -> None:
    d = Sharded(_distribution(rank, world).accelerator, wait_timeout_s=120, precision_mode="policy")
    d.mesh = mesh
    cfg = types.SimpleNamespace(n=2, m=4, skip_incompatible=False, model="tiny")
    reference = _scaled_reference()  # fp32, identical on every rank
    model = copy.deepcopy(reference)
    d.shard(model, None, cfg, say=lambda *a: None, fill=True)
    full = dict(reference.named_parameters())
    # no scaled weight is kept from forward to backward: each layer forms it again (nn/recomputed_linear.py)
    assert all(m.recompute_weight for m in model.modules() if isinstance(m, ScaledLinear))
    targets = {t.fqn + ".weight" for t in find_targets(model, n=2, m=4)}
    rows = torch.zeros(1, dtype=torch.int64)
    for name, p in model.named_parameters():
        if name.endswith(".scale"):  # whole, fp32, a plain tensor on every rank
            assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, name
            assert torch.equal(p, full[name]), name
            continue
        assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.placements == (Shard(0),), name
        if name in targets:  # every rank's rows are whole rows: its 2:4 groups (along dim 1) are whole
            local = p.to_local()
            assert local.shape[1] == full[name].shape[1] and local.shape[0] < full[name].shape[0], name
            start = sum(int(n) for n in _all_gather_int(local.shape[0], world)[:rank])
            assert torch.equal(local, full[name][start:start + local.shape[0]]), name
            if name.endswith("q_proj.base_layer.weight"):
                rows += local.shape[0]
    # what the forward sees: no autocast, the unsharded weights in bf16 (FSDP2's cast), the scales in fp32
    seen = {}
    layer = model.model.layers[0].self_attn.q_proj

    def record(mod, args):
        seen.update(weight=mod.base_layer.weight.dtype, scale=mod.scale.dtype,
                    autocast=torch.is_autocast_enabled("cpu"))

    handle = layer.register_forward_pre_hook(record)
    g = torch.Generator().manual_seed(4)
    batch = torch.randint(0, tiny.VOCAB, (world, 16), generator=g)
    model.zero_grad(set_to_none=True)
    with d.autocast():
        out = model(input_ids=batch[rank : rank + 1], labels=batch[rank : rank + 1])
        out.loss.backward()
    handle.remove()
    assert seen == {"weight": torch.bfloat16, "scale": torch.float32, "autocast": False}, seen
    assert out.logits.dtype == torch.bfloat16
    d.sync_gradients(model)
    got = {}
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, name  # reduce-scattered (and all-reduced) in fp32
        got[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    # one process, the same precision: bf16 copies of every weight, the scales fp32, no autocast
    same = copy.deepcopy(reference)
    for name, p in same.named_parameters():
        if not name.endswith(".scale"):
            p.data = p.data.bfloat16()
    want_bf16, want_fp32 = _grads_of(same, batch), _grads_of(reference, batch)
    for name in got:
        near = _rel(got[name], want_bf16[name])
        assert near < 1e-2, (name, near)  # bf16 rounding of different partial sums (one batch vs two ranks)
    total_near = sum(_rel(got[n], want_bf16[n]) for n in got)
    total_far = sum(_rel(got[n], want_fp32[n]) for n in got)
    assert total_near < 0.5 * total_far, (total_near, total_far)  # it IS the bf16 computation
    # clipping: the global norm of sharded + replicated gradients, each counted once
    norm = fsdp.clip_grad_norm_(list(model.parameters()), 1e9)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in got.values()]))
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)


def _all_gather_int(value: int, world: int) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, torch.tensor([value]))
    return [int(t) for t in out]


def check_errors_reach_every_rank(rank, world, shared: Path | None) -> None:
    d = _distribution(rank, world)
    try:
        with d.waiting_for_main("testing errors") as work:
            if work.main:
                raise CastError("something only rank 0 saw")
        raise AssertionError("no error")
    except CastError as e:
        assert str(e) == ("something only rank 0 saw" if rank == 0
                          else "rank 0 failed while testing errors: something only rank 0 saw"), str(e)
    with d.waiting_for_main("sharing") as work:
        if work.main:
            work.shared["x"] = 3
    assert work.shared == {"x": 3}
    assert d.first_error("disk full" if rank == 1 else None) == ("disk full" if rank == 1 else "on rank 1: disk full")
    # a checkpoint whose publishing fails on rank 0 alone fails on every rank; the previous one stays
    out = shared if shared is not None else Path(tempfile.mkdtemp())
    states = {"model": {"w": torch.full((2,), float(rank))}, "rng": {"x": rank}}
    d.save(out, 1, {**states, "scheduler": {"s": 1}}, {"fingerprint": {}}, keep=2)
    ck = out / "checkpoints"
    if rank == 0:
        meta = (ck / "step-00000001" / "meta.json").read_text()
        assert "model-rank00001.safetensors" in meta and (ck / "step-00000001" / ".cast-llm-checkpoint").is_file()
        import errno

        import cast_llm.train.checkpoint as checkpoint

        def full_disk(tmp, final, replace=False):  # rank 0's rename into place fails
            raise OSError(errno.ENOSPC, "No space left on device")

        checkpoint.publish_dir = full_disk
    dist.barrier()
    try:
        d.save(out, 2, {**states, "scheduler": {"s": 2}}, {"fingerprint": {}}, keep=2)
        raise AssertionError("no error")
    except CheckpointWriteError as e:
        assert "the previous checkpoint is intact" in str(e) and (rank == 0 or "on rank 0" in str(e)), str(e)
    assert [p.name for p in list_checkpoints(out)] == ["step-00000001"]
    states, _ = d.load(ck / "step-00000001", {})
    assert torch.equal(states["model"]["w"], torch.full((2,), float(rank)))


if __name__ == "__main__":
    main()
