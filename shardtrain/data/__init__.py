"""Data: from raw text to the rows of a global batch each process feeds its devices.

Offline, `shardtrain prepare` (prepare.py) tokenizes text, JSONL or Parquet (tokenize.py; chat
conversations through the model's template with an assistant-token loss mask, chat.py) into
token files and a manifest. At training time token_shards.py reads those files by byte range
(storage.py: local disk or a URL) as packed windows, and loader.py turns a source (prepared
tokens, text bytes or synthetic sequences, or a weighted mixture) into seeded, resumable grain
batches.

The package depends on nothing but `shardtrain.config`: the step builder and the training loop
import it, never the reverse (tests/test_imports.py checks).
"""
