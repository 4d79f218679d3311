"""Hugging Face models in and out: `import-hf`, `export-hf`, `checkpoint.init_from` and `generate`
read HF directories and our checkpoints through here.

Supported: LlamaForCausalLM (Llama 2/3/3.1/3.2), MistralForCausalLM, Qwen2ForCausalLM (Qwen2 /
Qwen2.5), Qwen3ForCausalLM and the mixtures of experts MixtralForCausalLM, Qwen2MoeForCausalLM
and Qwen3MoeForCausalLM, all as configs of the one decoder in models/gpt.py.

Modules, lower first (none imports the training loop):
  families.py        one table: each family's facts (attention, sliding window, MoE keys and tensor names)
  config.py          HF config.json <-> our ModelConfig
  layout.py          our parameter tree <-> HF tensor names and layouts (`Entry`, `tensor_map`)
  safetensors_io.py  safetensors read (memory-mapped) and write (one tensor at a time), numpy only
  io.py              an HF directory read (`HfDir`) and written (`export`)
  tokenizer.py       the tokenizer and EOS / BOS of a set of weights, found along its chain of
                     directories (run, init_from, prepared data), and written for transformers
  weights.py         weight sources (HF dir, import-hf dir, run, checkpoint step), LoRA merge,
                     the `import-hf` / `export-hf` commands
"""
