"""A tiny random Llama (or other family member) with a real tokenizer, built offline: the debug model
of the demo and tests.

The tokenizer is a sentencepiece BPE model trained on the documentation text that Python ships
(``pydoc_data.topics``), so nothing is downloaded. Same code path as a real Llama checkpoint:
``config.json`` + safetensors + ``tokenizer.model`` written by ``save_pretrained``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from transformers import PretrainedConfig

from models.families import FAMILIES, family_of

# Llama's special-token ids: <unk>=0, <s>=1, </s>=2; the tiny model has no padding token.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


GPT_OSS_YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0)


def tiny_config(model_type: str = "llama", **overrides) -> PretrainedConfig:
    """A config of the family ``model_type`` small enough to train in seconds on one CPU core (GQA: 4
    query, 2 KV heads). The family's own defaults hold otherwise: Mistral's 4096-token sliding window
    (longer than any test sequence unless overridden), Qwen2's q/k/v biases, Qwen3's q/k norms."""
    args = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3_moe":  # 4 experts of 48, 2 per token
        args.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    elif model_type == "mixtral":
        args.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    elif model_type == "llama4_text":  # Llama 4's differences, each visible in a 32-128 token test:
        args.update(
            num_local_experts=4,  # 4 experts of 48 and a shared expert of 48, top 1 (as Llama 4)
            num_experts_per_tok=1,
            intermediate_size=48,
            intermediate_size_mlp=176,  # the dense layers' MLP
            interleave_moe_layer_step=2,  # routed layers 1 and 3, dense 0 and 2
            no_rope_layer_interval=4,  # (its default) layer 3 without RoPE, full attention; 0-2 chunked
            attention_chunk_size=8,
            floor_scale=8,  # temperature tuning from position 7 on (8192 in Llama 4)
        )
    elif model_type == "deepseek_v3":  # latent attention of its own head sizes; layer 0 dense, then 8 experts
        args.update(
            num_key_value_heads=4,  # MLA expands its latent to every head (DeepSeek-V3: 128 of 128)
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,  # != 24, the query and key head size
            n_routed_experts=8,  # 4 groups of 2, tokens routed within the best 2 groups, 2 experts each
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            first_k_dense_replace=1,
            num_hidden_layers=3,
        )
    if model_type == "gpt_oss":  # 4 experts of 48, 2 per token; layers sliding (even) and full (odd) alternating
        args.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=8)
        # gpt-oss's YaRN (factor 32 over 4096 positions) scaled down: 32 x 16 = max_position_embeddings
        args["rope_parameters"] = dict(GPT_OSS_YARN, original_max_position_embeddings=16)
    if model_type == "gemma3_text":  # sliding and full layers alternating (Gemma 3: 5 sliding, then 1 full)
        layers = overrides.get("num_hidden_layers", args["num_hidden_layers"])
        args.update(
            layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
            sliding_window=8,  # shorter than the test sequences (4096 in Gemma 3: longer than any)
            query_pre_attn_scalar=24,  # scores scaled by 24 ** -0.5, not head_dim's 16 ** -0.5
        )
    if model_type == "gemma4_text":  # sliding, full, sliding, full; layers 2-3 reuse 0-1's keys and values
        layers = overrides.get("num_hidden_layers", args["num_hidden_layers"])
        args.update(
            layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
            sliding_window=8,
            head_dim=16,  # 256 in Gemma 4, and full layers' global_head_dim 512
            global_head_dim=32,
            hidden_size_per_layer_input=8,  # per-layer inputs of 8 per layer (256 in Gemma 4)
            vocab_size_per_layer_input=overrides.get("vocab_size", args["vocab_size"]),
            num_kv_shared_layers=layers // 2,
        )
    # head_dim defaults to 128 (Gemma: 256, gpt-oss: 64), not hidden / heads
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):  # layers 0-2 linear attention, 3 full (Qwen3.5's 3:1)
        args.update(
            head_dim=16,  # 256 in Qwen3.5; RoPE on its first quarter
            linear_num_key_heads=2,  # Gated DeltaNet: 2 query/key heads of 16, 4 value heads of 16
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
        if model_type == "qwen3_5_moe_text":  # 4 experts of 48 and a gated shared expert of 48, 2 per token
            args.update(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=48
            )
    if model_type in ("qwen3", "qwen3_moe", "llama4_text", "gemma3_text", "gpt_oss"):
        args["head_dim"] = overrides.get("hidden_size", args["hidden_size"]) // overrides.get(
            "num_attention_heads", args["num_attention_heads"]
        )
    args.update(overrides)
    return FAMILIES[model_type].config_class(**args)


def write_random_tokens(path: str, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """A ``data=tokens`` file of seeded random token ids (above the special tokens 0-2), one sample of
    ``seq_len`` ids per line; written to a temporary name and renamed, so a reader never sees half a file.
    Returns the samples."""
    g = torch.Generator().manual_seed(seed)
    samples = torch.randint(3, vocab_size, (num_samples, seq_len), generator=g).tolist()  # 3 = past <unk>, <s>, </s>
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w") as f:
        for ids in samples:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    os.replace(tmp, path)
    return samples


def corpus_documents() -> list[str]:
    """The offline corpus: one document per topic of Python's bundled documentation (~80 documents)."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def train_tokenizer(out_dir: str, vocab_size: int) -> None:
    """Train a sentencepiece BPE tokenizer on the corpus and save it as a Llama tokenizer in ``out_dir``."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    lines = [line for doc in corpus_documents() for line in doc.splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "tokenizer")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type="bpe",
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            byte_fallback=True,  # any byte stays encodable with a small vocabulary
            character_coverage=1.0,
            num_threads=1,
            minloglevel=2,
        )
        os.makedirs(out_dir, exist_ok=True)
        shutil.copy(prefix + ".model", os.path.join(out_dir, "tokenizer.model"))
    LlamaTokenizer.from_pretrained(out_dir).save_pretrained(out_dir)


def save_random_model(
    config: PretrainedConfig, out_dir: str, seed: int = 0, dtype: torch.dtype = torch.float32
) -> None:
    """Random weights (Hugging Face's own init for the family, seeded) saved with ``save_pretrained``."""
    torch.manual_seed(seed)
    model = family_of(config).causal_lm(config).to(dtype)
    model.save_pretrained(out_dir)


def write_uneven_sft(path: str, num_examples: int, seed: int = 0, run: int = 4) -> None:
    """A ``data=sft`` file of prompt/response pairs whose response lengths alternate, ``run`` examples
    at a time, between 1-3 and 20-30 words (words of the offline corpus): micro-batches with very
    different label-token counts, where a per-micro-batch mean and a per-token mean of the loss part
    ways. With shuffle off, data parallel 2 and micro-batches of 2, ``run=4`` makes every micro-batch
    one kind (rank r reads rows r, r+2, ...)."""
    import random

    rng = random.Random(seed)
    words = sorted({w for doc in corpus_documents() for w in doc.split() if w.isalpha() and len(w) <= 6})
    with open(path, "w") as f:
        for i in range(num_examples):
            short = (i // run) % 2 == 0
            prompt = " ".join(rng.choices(words, k=rng.randint(4, 8)))
            response = " ".join(rng.choices(words, k=rng.randint(1, 3) if short else rng.randint(20, 30)))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def write_preference_pairs(
    path: str, num_pairs: int, seed: int = 0, conversational: bool = False, shorter_chosen: bool = False
) -> None:
    """A ``data=dpo`` file of {prompt, chosen, rejected} pairs of corpus words, completions of 1-4 and 6-12 words
    (so a per-token mean and a per-sequence sum part ways), either one chosen at random, or with
    ``shorter_chosen`` always the shorter (a preference learnt within a few steps);
    ``conversational``: the prompt a user message, the completions assistant messages."""
    import random

    rng = random.Random(seed)
    words = sorted({w for doc in corpus_documents() for w in doc.split() if w.isalpha() and len(w) <= 6})
    text = lambda lo, hi: " ".join(rng.choices(words, k=rng.randint(lo, hi)))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(num_pairs):
            prompt, chosen, rejected = text(3, 8), text(1, 4), text(6, 12)
            if rng.random() < 0.5 and not shorter_chosen:
                chosen, rejected = rejected, chosen
            if conversational:
                prompt = [{"role": "user", "content": prompt}]
                chosen, rejected = ([{"role": "assistant", "content": c}] for c in (chosen, rejected))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")


def write_text_corpus(path: str) -> int:
    """The offline corpus as JSONL ``{"text": ...}`` lines (data.format=text); returns the document count."""
    docs = corpus_documents()
    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return len(docs)


def converted_random_model(work: str, **shape) -> str:
    """A random Llama of ``shape`` (tiny_config's fields) in ``work/hf``, converted once to ``work/ckpt``
    (the benchmark scripts' model; the tokenizer files are side files only: their data are token ids)."""
    from models.files.hf_convert import hf_to_stages

    hf, ckpt = os.path.join(work, "hf"), os.path.join(work, "ckpt")
    if not os.path.isdir(ckpt):
        save_random_model(tiny_config(**shape), hf, seed=0)
        train_tokenizer(hf, vocab_size=512)
        hf_to_stages(hf, ckpt)
    return ckpt
