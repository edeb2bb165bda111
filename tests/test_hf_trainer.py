"""CAST inside transformers.Trainer: AdamS is used, KD loss matches, the result is exactly 2:4."""

from __future__ import annotations

import copy

import tiny
import torch
from transformers import TrainingArguments

from cast_llm.deploy.export import verify_nm
from cast_llm.integrations.hf_trainer import CastArguments, CastTrainer, cast_kd_loss


class _Seqs(torch.utils.data.Dataset):
    def __init__(self, n=16, length=24, vocab=500):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_cast_trainer_trains_with_adams_and_ends_exactly_24(tmp_path):
    from cast_llm.optim import AdamS

    model = tiny.model("llama").train()
    teacher = copy.deepcopy(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4,
                             learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no",
                             logging_steps=4, lr_scheduler_type="constant", seed=0)
    trainer = CastTrainer(model=model, teacher=teacher, args=args, train_dataset=_Seqs(),
                          cast_args=CastArguments(l1_decay=1e-4, mask_interval=4, eta=0.5))
    trainer.train()
    assert isinstance(trainer.adams, AdamS)
    rows = verify_nm(trainer.model, n=2, m=4)
    assert len(rows) == 14 and all(r.sparsity == 0.5 for r in rows)
    assert not any("scale" in k for k in trainer.model.state_dict())
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_cast_kd_loss_matches_direct_computation():
    import torch.nn.functional as F

    s, t = tiny.model("llama", seed=1), tiny.model("llama", seed=2)
    ids = torch.randint(500, (2, 16))
    labels = ids.clone()
    labels[0, :5] = -100
    loss, _ = cast_kd_loss(s, t, {"input_ids": ids, "labels": labels}, eta=0.25)
    with torch.no_grad():
        ls, lt = s(ids).logits[:, :-1].double(), t(ids).logits[:, :-1].double()
    y = labels[:, 1:].flatten()
    keep = y != -100
    ps, pt = F.log_softmax(ls.flatten(0, 1), -1)[keep], F.log_softmax(lt.flatten(0, 1), -1)[keep]
    kl = (pt.exp() * (pt - ps)).sum(-1).mean()
    ce = F.nll_loss(ps, y[keep])
    torch.testing.assert_close(loss.double(), 0.25 * kl + 0.75 * ce, rtol=1e-5, atol=1e-6)
