"""Real execution: a Llama-family model in PyTorch over the paged K/V pool (see docs/torch-executor.md).

Import the modules directly (`tierserve.executors.pytorch.executor`, ...); this package
file imports nothing, so a module that needs no torch (`tokenizer.py`) loads without it.
"""
