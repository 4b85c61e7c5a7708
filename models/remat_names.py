"""Names of the activations a rematerialisation policy can keep, defined once.

The model tags these tensors with `jax.ad_checkpoint.checkpoint_name`; a tag
changes nothing in the forward pass. Whoever wraps a stacked unit in
`jax.checkpoint` (the training job) decides by name which tagged tensors the
backward pass reads back instead of recomputing (`model.remat_names`).
"""

from __future__ import annotations

# attention
QUERY_PROJ = "query_proj"            # [batch, length, heads, head_dim] x @ W_q, before RoPE
KEY_PROJ = "key_proj"                # [batch, length, kv_heads, head_dim] x @ W_k, before RoPE
VALUE_PROJ = "value_proj"            # [batch, length, kv_heads, head_dim] x @ W_v
ATTENTION_CONTEXT = "attention_context"  # [batch, length, heads, head_dim] softmax(q k^T) v
OUT_PROJ = "out_proj"                # [batch, length, embed] the attention output projection
# feed-forward (dense, and each expert's SwiGLU)
MLP_GATE = "mlp_gate"                # [..., mlp] x @ W_gate
MLP_UP = "mlp_up"                    # [..., mlp] x @ W_up
MLP_HIDDEN = "mlp_hidden"            # [..., mlp] silu(gate) * up, the input of W_down
# mixture of experts
EXPERT_INPUTS = "expert_inputs"      # [experts, groups, capacity, embed] tokens dispatched to expert slots
# the matmuls jax's dots_saveable does not see, which `dots` keeps by this name: those behind a custom
# gradient rule or a kernel (models.ops: matmuls from float32 sums, grouped matmuls, and a backend's)
MATMUL_SUMS = "matmul_sums"

ALL = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_CONTEXT, OUT_PROJ, MLP_GATE, MLP_UP, MLP_HIDDEN, EXPERT_INPUTS)

# MaxText's "minimal": every weight projection's output except the MLP's down projection
# (recomputed from the saved gate and up), plus the dispatched expert inputs (the MLP input of
# an MoE layer). Attention itself (scores, context) is recomputed.
MINIMAL = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ, MLP_GATE, MLP_UP, EXPERT_INPUTS)
