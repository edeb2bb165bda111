"""kd_loss (Eq. 13): float64 reference, chunking, η extremes, ignore_index, temperature, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cast_llm.distill import KDLoss, causal_kd_loss, kd_loss, shift_labels

B, T, V = 3, 7, 19


def reference(student, teacher, labels, eta, temperature=1.0, ignore_index=-100):
    """Eq. 13 written directly with F.kl_div + F.cross_entropy (autograd does the gradient)."""
    keep = labels != ignore_index
    s, t, y = student[keep], teacher[keep], labels[keep]
    n = y.numel()
    kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1),
                  log_target=True, reduction="sum") / n * temperature**2
    ce = F.cross_entropy(s, y, reduction="sum") / n
    return eta * kl + (1 - eta) * ce, kl, ce


def data(dtype=torch.float64, ignored=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = (3 * torch.randn(B, T, V, generator=gen)).to(dtype).requires_grad_(True)
    t = (3 * torch.randn(B, T, V, generator=gen)).to(dtype)
    y = torch.randint(0, V, (B, T), generator=gen)
    if ignored:
        y[0, :3] = -100
        y[2, -1] = -100
    return s, t, y


@pytest.mark.parametrize("eta", [0.0, 1 / 3, 2 / 3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("ignored", [False, True])
def test_matches_direct_computation_float64(eta, temperature, ignored):
    s, t, y = data(ignored=ignored)
    out = kd_loss(s, t, y, eta=eta, temperature=temperature, chunk_size=4)
    assert isinstance(out, KDLoss)
    (grad,) = torch.autograd.grad(out.loss, s)
    ref_loss, ref_kl, ref_ce = reference(s, t, y, eta, temperature)
    (ref_grad,) = torch.autograd.grad(ref_loss, s)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.kd, ref_kl.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.ce, ref_ce.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    if ignored:
        assert bool((grad[y == -100] == 0).all())


@pytest.mark.parametrize("ignored", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_unchunked(ignored, temperature):
    s, t, y = data(torch.float32, ignored=ignored)
    whole = kd_loss(s, t, y, temperature=temperature, chunk_size=None)
    (g_whole,) = torch.autograd.grad(whole.loss, s)
    for chunk in (1, 3, 8, 21, 1000):
        part = kd_loss(s, t, y, temperature=temperature, chunk_size=chunk)
        (g_part,) = torch.autograd.grad(part.loss, s)
        for a, b in zip(part, whole):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g_part, g_whole, rtol=1e-6, atol=1e-8)


def test_eta_extremes():
    s, t, y = data()
    ce_only = kd_loss(s, t, y, eta=0.0)
    torch.testing.assert_close(ce_only.loss, F.cross_entropy(s.flatten(0, 1), y.flatten()), rtol=1e-12, atol=0)
    no_teacher = kd_loss(s, None, y, eta=0.0)
    torch.testing.assert_close(no_teacher.loss, ce_only.loss, rtol=0, atol=0)
    assert no_teacher.kd.item() == 0.0
    kd_only = kd_loss(s, t, y, eta=1.0)
    torch.testing.assert_close(kd_only.loss, kd_only.kd, rtol=0, atol=0)
    assert kd_only.ce.item() > 0  # still reported
    # a student equal to the teacher has zero KD loss and a zero KD gradient
    same = kd_loss(t.clone().requires_grad_(True), t, y, eta=1.0)
    assert abs(same.loss.item()) < 1e-12


def test_temperature_uses_t_squared_convention():
    s, t, y = data(ignored=False)
    out = kd_loss(s, t, y, eta=1.0, temperature=4.0)
    p_t = F.softmax(t / 4, -1)
    kl = (p_t * (F.log_softmax(t / 4, -1) - F.log_softmax(s / 4, -1))).sum(-1).mean()
    torch.testing.assert_close(out.loss, 16 * kl, rtol=1e-12, atol=0)


def test_ignore_index_custom_and_ignored_rows_never_read():
    s, t, y = data(ignored=False)
    y = y.clone()
    y[1, 2:5] = -1
    with torch.no_grad():
        s_bad, t_bad = s.detach().clone(), t.clone()
        s_bad[1, 2:5] = float("nan")  # ignored tokens may hold anything (e.g. padding garbage)
        t_bad[1, 2:5] = float("inf")
    out = kd_loss(s_bad, t_bad, y, ignore_index=-1)
    ref, _, _ = reference(s, t, y, 2 / 3, ignore_index=-1)
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-12, atol=0)


def test_all_ignored_gives_zeros_not_nan():
    s, t, y = data()
    y = torch.full_like(y, -100)
    out = kd_loss(s, t, y)
    assert [v.item() for v in out] == [0.0, 0.0, 0.0]
    out.loss.backward()
    assert s.grad is None or bool((s.grad == 0).all())


def test_gradient_only_to_student_and_scaled_by_upstream():
    s, t, y = data()
    t = t.clone().requires_grad_(True)
    (2.5 * kd_loss(s, t, y).loss).backward()
    assert t.grad is None
    s2 = s.detach().clone().requires_grad_(True)
    ref, _, _ = reference(s2, t.detach(), y, 2 / 3)
    (2.5 * ref).backward()
    torch.testing.assert_close(s.grad, s2.grad, rtol=1e-10, atol=1e-12)
    assert not kd_loss(s, t, y).kd.requires_grad  # the parts are detached diagnostics


def test_backward_twice_is_a_clear_error():
    s, t, y = data()
    out = kd_loss(s, t, y)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        out.loss.backward()


def test_bf16_logits_close_to_fp32():
    s, t, y = data(torch.float32)
    ref = kd_loss(s, t, y)
    (g_ref,) = torch.autograd.grad(ref.loss, s)
    s16 = s.detach().bfloat16().requires_grad_(True)
    out = kd_loss(s16, t.bfloat16(), y)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and s16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s16.grad.float(), g_ref, rtol=5e-2, atol=2e-3)


def test_no_gradient_buffer_under_no_grad(monkeypatch):
    import cast_llm.distill.loss as distill

    seen = []
    real = distill._chunk_terms
    monkeypatch.setattr(distill, "_chunk_terms", lambda *a: seen.append(a[5]) or real(*a))
    s, t, y = data()
    with torch.no_grad():
        out = kd_loss(s, t, y)
    assert seen and not any(seen) and not out.loss.requires_grad
    kd_loss(s, t, y)
    assert seen[-1] is True


def test_two_dim_inputs():
    s, t, y = data()
    flat = kd_loss(s.flatten(0, 1), t.flatten(0, 1), y.flatten())
    torch.testing.assert_close(flat.loss, kd_loss(s, t, y).loss, rtol=0, atol=0)


def test_causal_kd_loss_shifts_labels():
    s, t, ids = data(ignored=False)
    assert torch.equal(shift_labels(torch.tensor([[5, 6, 7]])), torch.tensor([[6, 7, -100]]))
    out = causal_kd_loss(s, t, ids, eta=0.4)
    ref, _, _ = reference(s[:, :-1], t[:, :-1], ids[:, 1:], 0.4)
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=0)


def test_causal_kd_loss_with_eta_zero_is_the_hf_lm_loss():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[1, :4] = -100  # e.g. a masked prompt
    out = model(ids, labels=labels)
    ours = causal_kd_loss(out.logits, None, labels, eta=0.0)
    torch.testing.assert_close(ours.loss, out.loss, rtol=1e-6, atol=1e-6)


def test_validation_errors():
    s, t, y = data()
    with pytest.raises(ValueError, match=r"labels \(3, 6\).*\(3, 7, 19\)"):
        kd_loss(s, t, y[:, :-1])
    with pytest.raises(ValueError, match=r"teacher logits \(3, 7, 18\) and student logits \(3, 7, 19\)"):
        kd_loss(s, t[..., :-1], y)
    for eta in (-0.1, 1.5):
        with pytest.raises(ValueError, match="eta"):
            kd_loss(s, t, y, eta=eta)
    for temperature in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            kd_loss(s, t, y, temperature=temperature)
    with pytest.raises(ValueError, match="chunk_size"):
        kd_loss(s, t, y, chunk_size=0)
    with pytest.raises(ValueError, match="teacher_logits is None"):
        kd_loss(s, None, y, eta=0.5)
    bad = y.clone()
    bad[0, 5] = V
    with pytest.raises(ValueError, match=r"\[0, 19\)"):
        kd_loss(s, t, bad)
    with pytest.raises(TypeError, match="integer"):
        kd_loss(s, t, y.float())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_matches_cpu_float64():
    s, t, y = data(ignored=True)
    ref = kd_loss(s, t, y)
    (g_ref,) = torch.autograd.grad(ref.loss, s)
    s16 = s.detach().to("cuda", torch.bfloat16).requires_grad_(True)
    out = kd_loss(s16, t.to("cuda", torch.bfloat16), y.cuda(), chunk_size=5)
    out.loss.backward()
    torch.testing.assert_close(out.loss.cpu().double(), ref.loss.detach(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s16.grad.double().cpu(), g_ref, rtol=5e-2, atol=3e-3)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_smollm2_vocabulary_ragged_chunks_match_float64_formula(dtype, tol):
    """The torch (CPU) path at V = 49,152 with chunks that do not divide the tokens (14 rows: 5 + 5 + 4), an
    ignored row holding NaN, against Eq. 13 written out in float64. bf16: the gradient is rounded to bf16."""
    from step_kernel_checks import VOCAB, _reference_kd

    gen = torch.Generator().manual_seed(1)
    s = (3 * torch.randn(2, 7, VOCAB, generator=gen)).to(dtype)
    t = (3 * torch.randn(2, 7, VOCAB, generator=gen)).to(dtype)
    ids = torch.randint(0, VOCAB, (2, 7), generator=gen)
    ids[0, 4] = -100
    s[0, 3, 5] = float("nan")  # the row whose label is ids[0, 4]: ignored, never read
    s.requires_grad_(True)
    out = causal_kd_loss(s, t, ids, eta=0.5, chunk_size=5)
    (grad,) = torch.autograd.grad(out.loss, s)
    labels = shift_labels(ids).reshape(-1)
    r_loss, r_kl, r_ce, r_grad = _reference_kd(s.reshape(-1, VOCAB), t.reshape(-1, VOCAB), labels, 0.5, 1.0)
    keep = labels != -100
    for got, ref in ((out.loss, r_loss), (out.kd, r_kl), (out.ce, r_ce)):
        assert abs(float(got.detach()) - ref) <= max(1e-12, (tol if dtype != torch.bfloat16 else 1e-5) * abs(ref))
    g = grad.reshape(-1, VOCAB).double()
    assert bool((g[~keep] == 0).all())
    assert float((g[keep] - r_grad[keep]).abs().max() / r_grad[keep].abs().max()) <= tol
