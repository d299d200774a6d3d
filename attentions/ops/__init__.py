"""The operators the routing backends are built from, one folder per operator, each holding its
PyTorch form (reference.py), its C kernel for the CPU (cpu.py: a torch.library operator in the
``lra`` namespace, the C in attentions/csrc/), its Triton form where it has one, and one place
that decides which form runs and says why a form is refused (dispatch.py).

grouped/         grouped routed attention (MiTA's experts, MoBA's blocks) and the merge of partial results
landmark/        MiTA's landmark pooling, landmark pass and routing; MiTA's default form as one operator
topk_selection/  top-k along the last dim, in no order
row_products/    products with k table rows chosen per query (Top-k attention)
block_gate/      MoBA's choice of key blocks
ttt/             Test-Time Training's inner loop: the primal form (reference) and the dual form
native.py        builds and loads the C kernels (cc on first use, cached; none without a compiler)
tuning.py        host tuning: chunk and batch sizes that set speed and memory, never results
"""
