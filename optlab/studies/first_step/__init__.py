"""The first step of a compiled model: what compiling costs from cold and from warm caches, what makes compile fail
to pay (graph breaks and recompiles), and shapes that change.

``fresh`` runs one start in a fresh process with its own empty cache folders; ``starts`` is what runs inside it (the
model, the way it is compiled, the timed steps); ``compile_time`` turns many starts into the chapter's table of
first-step times, steady steps and break-evens; ``shapes`` streams batches of changing shape through each way of
compiling them; ``breaks`` and ``recompiles`` find graph breaks and failed guards, read from Dynamo's own messages
(``dynamo_log``).

Imports ``optlab.core`` only.
"""
