"""The Llama-style decoder family: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms) and,
with routed experts in its blocks (hpctrain.models.moe), Mixtral.

- `model`: the decoder and its parts (`Transformer`, built whole or as a pipeline stage);
- `hf_config`: a Hugging Face config.json as its shape (`ModelConfig`), and back;
- `hf_names`: where each weight lives in a Hugging Face directory;
- `FAMILY` below: what the parallel code needs to know of it, its tensor-parallel plan
  included (hpctrain.models.family).
"""

from hpctrain.models.family import ModelFamily
from hpctrain.models.llama.model import Transformer

FAMILY = ModelFamily(
    name="llama",
    build=Transformer,
    blocks="layers", embedding="tok_embeddings", norm="norm", head="output",
    attention_core="attn.core",
    # Megatron's layout: heads split (wq/wk/wv column, wo row), SwiGLU w1/w3 column and w2 row;
    # the norms before them are the column layers' shared entry; both ends vocab-parallel.
    # q/k norms act within a head, so they stay whole beside the heads each rank holds.
    tp_block={"attn_norm": "entry_norm", "mlp_norm": "entry_norm",
              "attn.q_norm": "head_norm", "attn.k_norm": "head_norm",
              "attn.wq": "column", "attn.wk": "column", "attn.wv": "column",
              "mlp.w1": "column", "mlp.w3": "column", "attn.wo": "row", "mlp.w2": "row"},
    tp_ends={"tok_embeddings": "vocab", "output": "column"},
    tp_kv=("attn.wk", "attn.wv"),
    block_mlp="mlp",
)
