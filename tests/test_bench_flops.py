"""bench/flops.py: the compute floor's FLOP count must follow the model code (its projection FLOPs
are twice the weights each token multiplies, counted on the loaded model), and a request's FLOPs
add up from its spans."""
from __future__ import annotations

import pytest
import torch

from radixflow.services.bench.flops import _per_token, request_flops, span_flops
from radixflow.services.executor.models import ModelSpec, load_model


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_projection_flops_are_twice_the_weights_a_token_multiplies(models, name):
    spec = ModelSpec.from_dir(models[name])
    model = load_model(models[name], torch.device("cpu"), torch.float32)
    weights = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    proj, per_key = _per_token(spec)
    recurrence = sum(2 * 3 * spec.lin_num_v_heads * spec.lin_k_dim * spec.lin_v_dim
                     for t in spec.layer_types if t != "full_attention")
    assert proj - recurrence == 2 * weights
    attn = [t for t in spec.layer_types if t == "full_attention"]
    assert per_key == len(attn) * 4 * spec.num_heads * spec.head_dim
    assert (recurrence > 0) == spec.is_hybrid


def test_request_flops_add_up_from_spans(models):
    spec = ModelSpec.from_dir(models["tiny-dense"])
    head = 2 * spec.hidden_size * spec.vocab_size
    proj, per_key = _per_token(spec)
    # positions 0..9: 10 tokens reading 1..10 keys, one logits row
    assert span_flops(spec, 0, 10) == 10 * proj + 55 * per_key + head
    # 6 cached: only positions 6..9 (7..10 keys), then 2 of 3 output tokens fed back (11 and 12 keys)
    assert request_flops(spec, 10, 6, 3) == (4 * proj + 34 * per_key + head) + 2 * proj + 23 * per_key + 2 * head
    assert request_flops(spec, 10, 10, 1) == 0.0
