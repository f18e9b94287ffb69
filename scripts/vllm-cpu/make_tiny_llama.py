"""Create a tiny, randomly initialised Llama model + offline-trained BPE tokenizer.
Usage (in the vLLM venv): python make_tiny_llama.py OUT_DIR   (scripts/vllm-cpu/setup.sh runs it)"""
import glob
import os
import sys
import sysconfig

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
torch.manual_seed(0)

# --- corpus: any offline text (python stdlib sources + some English) ---
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
def corpus():
    for f in files:
        with open(f, encoding="utf-8", errors="ignore") as fh:
            yield fh.read()
    yield "The quick brown fox jumps over the lazy dog. Hello world! " * 100

special = ["<unk>", "<s>", "</s>", "<pad>"]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=special,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
tok.train_from_iterator(corpus(), trainer=trainer)
bos_id = tok.token_to_id("<s>")
tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])

chat_template = (
    "{% for message in messages %}"
    "{{ '<s>' if loop.first else '' }}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", pad_token="<pad>",
                                 model_max_length=512)
hf_tok.chat_template = chat_template
hf_tok.save_pretrained(OUT)

vocab = len(hf_tok)
cfg = LlamaConfig(
    vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=32,
    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
    pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.generation_config.bos_token_id = hf_tok.bos_token_id
model.generation_config.eos_token_id = hf_tok.eos_token_id
model.generation_config.pad_token_id = hf_tok.pad_token_id
model.save_pretrained(OUT, safe_serialization=True)
n = sum(p.numel() for p in model.parameters())
print(f"saved to {OUT}: vocab={vocab} params={n/1e6:.2f}M")
print(hf_tok("Hello world").input_ids, hf_tok.decode(hf_tok("Hello world").input_ids))
print(hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True))
