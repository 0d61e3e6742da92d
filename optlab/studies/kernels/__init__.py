"""One operation or one step, timed or checked apart: micro-benchmarks of copies and matmuls (``microbench``), cuDNN
autotuning (``autotune``), TF32's switches (``tf32``) and the numerics of each precision (``numerics``), CUDA graphs
(``cuda_graphs``), and what torch.compile costs (``compile_block``, ``compile_cost``).

Imports ``optlab.core`` only.
"""
