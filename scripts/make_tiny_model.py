#!/usr/bin/env python3
"""Build a tiny random-weight Llama model + locally trained BPE tokenizer, fully offline.

Usage: HF_HUB_OFFLINE=1 python make_tiny_model.py OUT_DIR
Optional env: TINY_HIDDEN (128), TINY_LAYERS (2), TINY_HEADS (4) -> head_dim = hidden/heads (must be >= 32).
"""
import glob
import os
import sys
import sysconfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
os.makedirs(out, exist_ok=True)

# ---- 1. tokenizer: byte-level BPE trained on CPython's own stdlib sources ----
stdlib = sysconfig.get_paths()["stdlib"]
files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:200]  # ~ a few MB of text, trains in seconds
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
trainer = trainers.BpeTrainer(
    vocab_size=4096,
    min_frequency=2,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train(files, trainer)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
hf_tok = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token="<|endoftext|>",
    eos_token="<|im_end|>",
    unk_token="<|endoftext|>",
    pad_token="<|pad|>",
    model_max_length=512,
)
hf_tok.chat_template = CHAT_TEMPLATE
hf_tok.save_pretrained(out)
vocab_size = len(hf_tok)

# ---- 2. model: Llama, default 2 layers, hidden 128, 4 heads (head_dim 32; vLLM CPU attention needs >= 32) ----
HIDDEN = int(os.environ.get("TINY_HIDDEN", "128"))
LAYERS = int(os.environ.get("TINY_LAYERS", "2"))
HEADS = int(os.environ.get("TINY_HEADS", "4"))
assert HIDDEN % HEADS == 0 and HIDDEN // HEADS >= 32, "vLLM CPU attention needs head_dim >= 32"
torch.manual_seed(0)
cfg = LlamaConfig(
    vocab_size=vocab_size,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=max(1, HEADS // 2),
    head_dim=HIDDEN // HEADS,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=hf_tok.bos_token_id,
    eos_token_id=hf_tok.eos_token_id,
    pad_token_id=hf_tok.pad_token_id,
    torch_dtype="float32",
)
model = LlamaForCausalLM(cfg).to(torch.float32).eval()
model.save_pretrained(out, safe_serialization=True)
model.generation_config.save_pretrained(out)
n = sum(p.numel() for p in model.parameters())
print(f"saved to {out}: vocab={vocab_size} params={n/1e6:.2f}M")
