"""Tiny random models and corpora for tests: built locally from configs, seeded, no hub."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512  # tiny byte-level BPE: small logits keep every test step fast

_TOKENIZER = None


def tokenizer():
    """A byte-level BPE with VOCAB entries, trained in milliseconds on local text (no hub, no cache)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([CORPUS] * 4 + [CORPUS.lower(), CORPUS.upper()], trainer)
        _TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                             bos_token="<|endoftext|>", pad_token="<|endoftext|>")
        assert len(_TOKENIZER) <= VOCAB
    return _TOKENIZER


def config(arch: str, **overrides):
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    if arch == "llama":
        kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=True)
        cls = LlamaConfig
    elif arch == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128)
        cls = GPT2Config
    elif arch == "opt":
        kw = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                  word_embed_proj_dim=64, max_position_embeddings=128)
        cls = OPTConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    tok = tokenizer()
    kw.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return cls(**kw)


def model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(arch, **overrides)).eval()


def save_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    m = model(arch, seed, **overrides)
    m.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


CORPUS = (
    "The quick brown fox jumps over the lazy dog. Sparse networks keep two of every four weights. "
    "Semi-structured sparsity is accelerated by tensor cores. Training with distillation recovers quality. "
)


def write_corpus(path: Path, docs: int = 40) -> Path:
    """A small .jsonl corpus of varied documents (a few thousand tokens)."""
    import json

    words = CORPUS.split()
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for i in range(docs):
            idx = torch.randint(len(words), (60,), generator=g).tolist()
            f.write(json.dumps({"text": f"Document {i}. " + " ".join(words[j] for j in idx)}) + "\n")
    return path


def write_gguf(path: Path, layers: int = 2, d: int = 16, ff: int = 32, heads: int = 2, vocab: int = 40) -> Path:
    """A tiny random fp32 LLaMA as a GGUF file (gguf's own writer), with a 40-token BPE tokenizer: what
    ``from_pretrained(..., gguf_file=...)`` reads, in a fraction of a second."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"] + [f"x{i}" for i in range(vocab - 3)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (vocab, d), "output_norm": (d,), "output": (vocab, d)}
    for i in range(layers):
        shapes.update({f"blk.{i}.{n}": s for n, s in (
            ("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)), ("attn_output", (d, d)),
            ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff)), ("attn_norm", (d,)),
            ("ffn_norm", (d,)))})
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
