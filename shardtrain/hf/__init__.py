"""Hugging Face formats: config.json, tensor names and layouts, safetensors files and tokenizers, read
and written. shardtrain/weights.py (`import-hf`, `export-hf`, `checkpoint.init_from`, `generate`)
moves weights through here.

Supported: every family of `families.FAMILIES` (Llama 2/3/3.1/3.2, Mistral, Qwen2 / Qwen2.5, Qwen3,
OLMo 2, Gemma 2, Gemma 3, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3), all as configs of the one decoder in models/gpt.py.

Modules, lower first (the package imports only config/ and data/):
  families.py        one table: each family's facts (attention, sliding window, MoE keys and tensor names)
  config.py          HF config.json <-> our ModelConfig
  layout.py          our parameter tree <-> HF tensor names and layouts (`Entry`, `tensor_map`)
  safetensors_io.py  safetensors read (memory-mapped) and write (one tensor at a time), numpy only
  io.py              an HF directory read (`HfDir`) and written (`export`)
  tokenizer.py       the tokenizer and EOS / BOS of a set of weights, found along its chain of
                     directories (run, init_from, prepared data), and written for transformers
"""
