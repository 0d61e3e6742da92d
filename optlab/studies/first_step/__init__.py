"""The first step of a compiled model: what compiling costs from cold and from warm caches, and shapes that change.

``fresh`` runs one start in a fresh process with its own empty cache folders; ``starts`` is what runs inside it (the
model, the way it is compiled, the timed steps); ``compile_time`` turns many starts into the chapter's table of
first-step times, steady steps and break-evens; ``shapes`` streams batches of changing shape through each way of
compiling them.

Imports ``optlab.core`` only.
"""
