"""Prefill/decode disaggregation on engines (the service path is tested in test_disaggregation_served):
a prefill engine computes a prompt, its pages (and a hybrid model's state) move as KVPages into a
decode engine's host tier, and the request decoded there answers as on one engine, computing only
the prompt's last partial page; the bytes moved are the pages'."""
from __future__ import annotations

import math

import pytest
import torch

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.services.executor.transfer import parts
from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import ExecRequest, SamplingParams

PAGE = 16


def _engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model, page_size=PAGE, max_total_tokens=4096, max_running_requests=4,
                               warmup_tokens=0, **kw))


def _run(eng: Engine, req: ExecRequest) -> dict:
    eng.add(req)
    out = {"tokens": [], "logprobs": [], "cached": 0, "reason": None}
    while eng.has_work():
        for _, o in eng.step():
            out["tokens"] += o.token_ids
            out["logprobs"] += o.logprobs
            if o.finished:
                out["cached"], out["reason"] = o.cached_tokens, o.finish_reason
    return out


def _req(rid: str, ids: list[int], n: int, **kw) -> ExecRequest:
    return ExecRequest(rid=rid, input_ids=ids, eos_token_ids=[], namespace="tenant-a",
                       sampling=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=n > 0), **kw)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
def test_pages_moved_from_a_prefill_engine_decode_as_on_one(models, preset):
    ids = torch.randint(3, 8000, (333,), generator=torch.Generator().manual_seed(4)).tolist()
    prefill, decode = _engine(models[preset]), _engine(models[preset], kv_host_pages=256)
    first = _run(prefill, _req("p", ids, 0, transfer_to="decode-1"))
    assert first["reason"] == "length" and first["tokens"] == []
    export = prefill.exports.pop("p")
    assert export[0] == "decode-1" and len(export[2]) == 320 and export[3] == 0   # 20 whole pages of the 333 tokens
    msgs = parts(export, max_bytes=200_000)
    assert len(msgs) > 1 and sum(m.count for m in msgs) == 20 and all(m.state == b"" for m in msgs[:-1])
    moved = sum(decode.import_pages(m)[1] for m in msgs)
    spec = decode.spec
    page_bytes = 2 * len(spec.attn_layers) * PAGE * spec.num_kv_heads * spec.head_dim * 4
    states = sum(len(m.state) for m in msgs)
    assert moved == 20 * page_bytes + states                           # the bytes are the pages' (and the state)
    assert (states > 0) == (preset == "tiny-hybrid")
    got = _run(decode, _req("r", ids, 8))
    want = _run(_engine(models[preset], disable_radix_cache=True), _req("r", ids, 8))
    assert got["tokens"] == want["tokens"]
    torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"]), atol=1e-4, rtol=0)
    assert got["cached"] == 320 and decode.stats()["prefill_tokens_computed_total"] == 333 - 320


def test_pages_that_do_not_fit_the_receiver_are_refused(models):
    ids = torch.randint(3, 8000, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    prefill = _engine(models["tiny-dense"])
    _run(prefill, _req("p", ids, 0, transfer_to="x"))
    msg = parts(prefill.exports.pop("p"))[0]
    with pytest.raises(BadRequest, match="no host tier"):
        _engine(models["tiny-dense"]).import_pages(msg)
    receiver = _engine(models["tiny-dense"], kv_host_pages=64)
    import msgspec
    with pytest.raises(BadRequest, match="do not make"):
        receiver.import_pages(msgspec.structs.replace(msg, data=msg.data[:-4]))
    with pytest.raises(BadRequest, match="bfloat16"):
        receiver.import_pages(msgspec.structs.replace(msg, dtype="bfloat16"))
    other = _engine(models["tiny-hybrid"], kv_host_pages=64)      # another model's layout
    if math.prod(other.tiers.page_shape()) != math.prod(receiver.tiers.page_shape()):
        with pytest.raises(BadRequest):
            other.import_pages(msg)


def test_only_the_pages_the_decode_engine_lacks_move(models):
    """transfer_from: the decode engine has the first 160 tokens cached (an earlier request over the
    same preamble); only pages 10.. move, and the request decodes as on one engine."""
    ids = torch.randint(3, 8000, (333,), generator=torch.Generator().manual_seed(6)).tolist()
    prefill, decode = _engine(models["tiny-dense"]), _engine(models["tiny-dense"], kv_host_pages=256)
    _run(decode, _req("warm", ids[:170], 1))                        # caches pages 0..9 there
    _run(prefill, _req("p", ids, 0, transfer_to="d", transfer_from=160))
    msgs = parts(prefill.exports.pop("p"))
    assert msgs[0].first == 10 and sum(m.count for m in msgs) == 10
    for m in msgs:
        decode.import_pages(m)
    got = _run(decode, _req("r", ids, 8))
    want = _run(_engine(models["tiny-dense"], disable_radix_cache=True), _req("r", ids, 8))
    assert got["tokens"] == want["tokens"] and got["cached"] == 320
    assert decode.stats()["tier_loaded_tokens_total"] == 160
