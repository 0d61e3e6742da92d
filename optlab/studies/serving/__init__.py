"""Serving the book's GPT: generating tokens from a prompt, as a request sees it.

One module per job: ``generation`` (greedy and sampled decoding with no cache, a growing KV cache or a static
pre-allocated one, prefill and decode timed apart, every variant checked against the no-cache greedy reference),
``bandwidth`` (the bytes a decode step reads, the memory-bandwidth bound and MBU), and the modules of the quantization, speculative decoding and serving chapters. Import the
modules directly (``from optlab.studies.serving import generation``): this package's namespace re-exports nothing.
"""
